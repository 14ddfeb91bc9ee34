// torch.ops.tritonspec_cpu.linear: linear.c's row-invariant kernel as a PyTorch operator, so eager calls
// and compiled rounds (inductor calls it from C++) reach it without a Python frame (~4.6 us a call
// against ~6 through ctypes and ~24 through a Python custom op). Built beside linear.c by
// kernels/cpu_linear.py when a C++ compiler and PyTorch's headers are there; otherwise the ctypes
// path runs the same kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

extern "C" {
void tritonspec_linear_f32(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*,
                           int64_t, int);
void tritonspec_linear_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
                            uint16_t*, int64_t, int);
}

namespace {

constexpr int64_t kSmall = int64_t(1) << 17;  // cpu_linear.SMALL: fewer multiply-adds run on one thread

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tritonspec_cpu::linear takes float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && (!b || b->scalar_type() == x.scalar_type()),
              "tritonspec_cpu::linear: x, weight and bias must share one dtype");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(-1) && w.is_contiguous(),
              "tritonspec_cpu::linear needs a contiguous [N, K] weight with K = x.size(-1)");
  TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous()),
              "tritonspec_cpu::linear: bias must be a contiguous [N] tensor");
  const int64_t K = x.size(-1), N = w.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t M = N ? y.numel() / N : 0;
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? y.copy_(b->expand_as(y)) : y.zero_();
  at::Tensor xc = x.reshape({M, K});
  if (xc.stride(1) != 1) xc = xc.contiguous();
  const int nt = threads > 0 ? int(threads) : (M * N * K >= kSmall ? at::get_num_threads() : 1);
  if (x.scalar_type() == at::kFloat) {
    tritonspec_linear_f32(xc.const_data_ptr<float>(), M, xc.stride(0), w.const_data_ptr<float>(), N, K,
                          b ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), N, nt);
  } else {
    tritonspec_linear_bf16(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), M, xc.stride(0),
                           reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()), N, K,
                           b ? reinterpret_cast<const uint16_t*>(b->const_data_ptr<c10::BFloat16>()) : nullptr,
                           reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), N, nt);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(tritonspec_cpu, m) { m.def("linear(Tensor x, Tensor weight, Tensor? bias, int threads=-1) -> Tensor"); }

TORCH_LIBRARY_IMPL(tritonspec_cpu, CPU, m) { m.impl("linear", &linear); }
