// torch.ops.tritonspec_cpu.linear, .tree_attention, .rms_norm, .rope, .kv_write, .verify_greedy, .build_tree,
// .ngram_lookup, .graft_chain, .kv_compact, .row_random, .verify_chain, .argmax, .aux_gather, .silu_mul, .drafter_step,
// .draft_chain, .draft_tree, .catch_up, .commit_history and .target_step: the kernels of linear.c, attention.c,
// norm.c, rope_kv.c and tree_ops.c as PyTorch operators, so eager calls and compiled rounds (inductor calls them from C++) reach them
// without a Python frame (~4.6 us a call against ~6 through ctypes and ~24 through a Python custom op).
// Built beside the C sources by kernels/cpu_linear.py when a C++ compiler and PyTorch's headers are
// there; otherwise the ctypes path runs the same kernels.
#include <algorithm>
#include <cfloat>
#include <initializer_list>
#include <vector>
#include <tuple>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/full.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

extern "C" {
void tritonspec_linear_f32(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*,
                           int64_t, int);
void tritonspec_linear_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
                            uint16_t*, int64_t, int);
void tritonspec_linear_f32_panels(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                                  float*, int64_t, int);
int tritonspec_linear_f32_bf16_panels(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                      const float*, float*, int64_t, int);
int tritonspec_linear_bf16_panels(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                  const uint16_t*, uint16_t*, int64_t, int);
int tritonspec_linear_bf16_packed(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                  const uint16_t*, uint16_t*, int64_t, int);
int tritonspec_tree_attention_f32(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, const int64_t*, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  float, float*, int);
int tritonspec_tree_attention_bf16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, const int64_t*, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, float, uint16_t*, int);
void tritonspec_rope_f32(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                         const float*, int64_t, int64_t, float*);
void tritonspec_rope_bf16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          const uint16_t*, const uint16_t*, int64_t, int64_t, uint16_t*);
int64_t tritonspec_kv_write(char*, int64_t, int64_t, int64_t, const char*, int64_t, int64_t, const int64_t*, int64_t,
                            int64_t, int64_t, int64_t);
void tritonspec_rms_norm_f32(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, float, float*,
                             float*, int);
void tritonspec_verify_greedy(const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t*,
                              int64_t*, int64_t*);
void tritonspec_build_tree(const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t*,
                           int64_t*, uint8_t*, int64_t*);
void tritonspec_ngram_lookup(const int64_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t*, uint8_t*);
void tritonspec_graft_chain(const int64_t*, const int64_t*, const int64_t*, const uint8_t*, const int64_t*,
                            const uint8_t*, int64_t, int64_t, int64_t, int64_t*, int64_t*, int64_t*, uint8_t*, int64_t*,
                            uint8_t*);
int64_t tritonspec_kv_compact(char*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                              const int64_t*, int64_t, int64_t, int64_t, char*);
void tritonspec_row_hash(const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t*);
void tritonspec_argmax(const void*, int, int64_t, int64_t, int64_t, int64_t*, int);
void tritonspec_verify_chain(const int64_t*, const float*, const float*, const float*, const float*, int64_t, int64_t,
                             int64_t, int64_t*, int64_t*, int64_t*);
void tritonspec_rms_norm_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t,
                              float, uint16_t*, uint16_t*, int);
void tritonspec_silu_mul_f32(const float*, int64_t, int64_t, int64_t, float*, int);
void tritonspec_silu_mul_bf16(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int);
}

namespace {

constexpr int64_t kSmall = int64_t(1) << 17;  // cpu_linear.SMALL: fewer multiply-adds run on one thread

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tritonspec_cpu::linear takes float32 or bfloat16, got ", x.scalar_type());
  // weight-only bfloat16 (cpu_linear.weight_only_bf16): float32 x and bias, bfloat16 panels
  const bool bf16w = w.dim() == 3 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16w || w.scalar_type() == x.scalar_type()) && (!b || b->scalar_type() == x.scalar_type()),
              "tritonspec_cpu::linear: x, weight and bias must share one dtype (or float32 x and bias with "
              "bfloat16 panels)");
  // a 4-D weight is packed for AMX (cpu_linear.pack_bf16): [N/16, K/32, 16, 32] bfloat16; a 3-D one into
  // panels of x's dtype (cpu_linear.pack_panels): [N/16, K, 16]
  const bool packed = w.dim() == 4, panels = w.dim() == 3;
  TORCH_CHECK((w.dim() == 2 && w.size(1) == x.size(-1) && w.is_contiguous()) ||
                  (packed && x.scalar_type() == at::kBFloat16 && w.size(1) * 32 == x.size(-1) && w.size(2) == 16 &&
                   w.size(3) == 32 && w.is_contiguous()) ||
                  (panels && w.size(1) == x.size(-1) && w.size(2) == 16 && w.is_contiguous()),
              "tritonspec_cpu::linear needs a contiguous [N, K] weight with K = x.size(-1), a bfloat16 weight "
              "packed by cpu_linear.pack_bf16 or one packed by cpu_linear.pack_panels");
  const int64_t K = x.size(-1), N = packed || panels ? w.size(0) * 16 : w.size(0);
  TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == N && b->is_contiguous()),
              "tritonspec_cpu::linear: bias must be a contiguous [N] tensor");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t M = N ? y.numel() / N : 0;
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? y.copy_(b->expand_as(y)) : y.zero_();
  at::Tensor xc = x.reshape({M, K});
  if (xc.stride(1) != 1) xc = xc.contiguous();
  const int nt = threads > 0 ? int(threads) : (M * N * K >= kSmall ? at::get_num_threads() : 1);
  if (bf16w) {
    int rc = tritonspec_linear_f32_bf16_panels(
        xc.const_data_ptr<float>(), M, xc.stride(0), reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()),
        N, K, b ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), N, nt);
    TORCH_CHECK(rc == 0, "tritonspec_cpu::linear: the weight-only bfloat16 kernel failed");
  } else if (panels && x.scalar_type() == at::kBFloat16) {
    int rc = tritonspec_linear_bf16_panels(
        reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), M, xc.stride(0),
        reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()), N, K,
        b ? reinterpret_cast<const uint16_t*>(b->const_data_ptr<c10::BFloat16>()) : nullptr,
        reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), N, nt);
    TORCH_CHECK(rc == 0, "tritonspec_cpu::linear: out of memory for the float32 copy of x (bfloat16 panels)");
  } else if (panels) {
    tritonspec_linear_f32_panels(xc.const_data_ptr<float>(), M, xc.stride(0), w.const_data_ptr<float>(), N, K,
                                 b ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), N, nt);
  } else if (x.scalar_type() == at::kFloat) {
    tritonspec_linear_f32(xc.const_data_ptr<float>(), M, xc.stride(0), w.const_data_ptr<float>(), N, K,
                          b ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), N, nt);
  } else if (packed) {
    int rc = tritonspec_linear_bf16_packed(
        reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), M, xc.stride(0),
        reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()), N, K,
        b ? reinterpret_cast<const uint16_t*>(b->const_data_ptr<c10::BFloat16>()) : nullptr,
        reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), N, nt);
    TORCH_CHECK(rc == 0, "tritonspec_cpu::linear: the weight is packed for AMX but AMX is off in this process "
                         "(TRITONSPEC_CPU_AMX=0, or the kernel refused the tile state): load the target with "
                         "weight_layout='nk'");
  } else {
    tritonspec_linear_bf16(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), M, xc.stride(0),
                           reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()), N, K,
                           b ? reinterpret_cast<const uint16_t*>(b->const_data_ptr<c10::BFloat16>()) : nullptr,
                           reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), N, nt);
  }
  return y;
}

// attention.c: q [B, Q, Hq, D], caches [>=B, >=S, Hkv, D] (unit stride along D, D-strided heads), prefix_lens
// [B] int64, tree_mask [B, Q, T] bool; slots >= kv_len are never read. Returns [B, Q, Hq, D] contiguous.
at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prefix_lens,
                          const at::Tensor& tree_mask, double scale, int64_t kv_len, int64_t threads) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "tritonspec_cpu::tree_attention takes float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "tritonspec_cpu::tree_attention: q and the caches must share one dtype");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "tritonspec_cpu::tree_attention: q [B, Q, Hq, D], "
              "k_cache and v_cache [B_max, S, Hkv, D]");
  const int64_t B = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(2), T = tree_mask.size(-1);
  TORCH_CHECK(k.size(3) == D && k.size(0) >= B && Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 16 && D <= 256,
              "tritonspec_cpu::tree_attention: shapes q ", q.sizes(), " k_cache ", k.sizes(), " not supported");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
              "tritonspec_cpu::tree_attention: unit stride along D and D-strided heads needed");
  TORCH_CHECK(prefix_lens.scalar_type() == at::kLong && prefix_lens.numel() == B && prefix_lens.is_contiguous(),
              "tritonspec_cpu::tree_attention: prefix_lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool && tree_mask.dim() == 3 && tree_mask.size(0) == B &&
                  tree_mask.size(1) == Q,
              "tritonspec_cpu::tree_attention: tree_mask must be a bool [B, Q, T] tensor");
  at::Tensor out = at::empty({B, Q, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  const int64_t S = std::min<int64_t>(kv_len >= 0 ? kv_len : k.size(1), k.size(1));
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  const auto* pl = prefix_lens.const_data_ptr<int64_t>();
  const auto* tm = reinterpret_cast<const uint8_t*>(tree_mask.const_data_ptr<bool>());
  int rc;
  if (q.scalar_type() == at::kFloat) {
    rc = tritonspec_tree_attention_f32(q.const_data_ptr<float>(), B, Q, Hq, D, q.stride(0), q.stride(1), q.stride(2),
                                       k.const_data_ptr<float>(), v.const_data_ptr<float>(), Hkv, k.stride(0),
                                       k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), pl, tm,
                                       tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2), T, S,
                                       float(scale), out.mutable_data_ptr<float>(), nt);
  } else {
    auto u16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<c10::BFloat16>()); };
    rc = tritonspec_tree_attention_bf16(u16(q), B, Q, Hq, D, q.stride(0), q.stride(1), q.stride(2), u16(k), u16(v), Hkv,
                                        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), pl,
                                        tm, tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2), T, S,
                                        float(scale),
                                        reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>()), nt);
  }
  TORCH_CHECK(rc != -2, "tritonspec_cpu::tree_attention: out of memory for the shared-prefix scratch");
  TORCH_CHECK(rc == 0, "tritonspec_cpu::tree_attention: unsupported head shape");
  return out;
}

// norm.c: (y, s) with s = x + residual (an empty tensor without residual) and y = RMSNorm(s) * weight.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                            const std::optional<at::Tensor>& r, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tritonspec_cpu::rms_norm takes float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && (!r || r->scalar_type() == x.scalar_type()),
              "tritonspec_cpu::rms_norm: x, weight and residual must share one dtype");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.is_contiguous(), "tritonspec_cpu::rms_norm: weight must be [H]");
  TORCH_CHECK(!r || r->sizes() == x.sizes(), "tritonspec_cpu::rms_norm: residual must have x's shape");
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor s = r ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  const int64_t M = H ? x.numel() / H : 0;
  if (M == 0 || H == 0) return {y, s};
  at::Tensor xc = x.reshape({M, H});
  if (xc.stride(1) != 1) xc = xc.contiguous();
  at::Tensor rc;
  if (r) {
    rc = r->reshape({M, H});
    if (rc.stride(1) != 1) rc = rc.contiguous();
  }
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  if (x.scalar_type() == at::kFloat) {
    tritonspec_rms_norm_f32(xc.const_data_ptr<float>(), xc.stride(0), r ? rc.const_data_ptr<float>() : nullptr,
                            r ? rc.stride(0) : 0, w.const_data_ptr<float>(), M, H, float(eps),
                            y.mutable_data_ptr<float>(), r ? s.mutable_data_ptr<float>() : nullptr, nt);
  } else {
    auto c16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<c10::BFloat16>()); };
    auto m16 = [](at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr<c10::BFloat16>()); };
    tritonspec_rms_norm_bf16(c16(xc), xc.stride(0), r ? c16(rc) : nullptr, r ? rc.stride(0) : 0, c16(w), M, H,
                             float(eps), m16(y), r ? m16(s) : nullptr, nt);
  }
  return {y, s};
}

// norm.c: SwiGLU's gate product silu(gate) * up of x = [gate | up] along the last dim (x [..., 2I], unit stride
// along it) -> [..., I] contiguous (kernels/cpu_norm.py silu_mul).
at::Tensor silu_mul(const at::Tensor& x, int64_t threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tritonspec_cpu::silu_mul takes float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0 && x.stride(-1) == 1,
              "tritonspec_cpu::silu_mul: x must be [..., 2 * I] with unit stride along its last dim");
  const int64_t I = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t M = I ? y.numel() / I : 0;
  if (M == 0) return y;
  at::Tensor xc = x.reshape({M, 2 * I});
  if (xc.stride(1) != 1) xc = xc.contiguous();
  const int nt = threads > 0 ? int(threads) : at::get_num_threads();
  if (x.scalar_type() == at::kFloat) {
    tritonspec_silu_mul_f32(xc.const_data_ptr<float>(), xc.stride(0), M, I, y.mutable_data_ptr<float>(), nt);
  } else {
    tritonspec_silu_mul_bf16(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), xc.stride(0), M,
                             I, reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), nt);
  }
  return y;
}

// EAGLE-3.1's fc_norm gather (kernels/aux_gather.py): out[i] = the n_aux H-wide chunks of aux[index[i]], chunk c
// through norm.c's RMSNorm with weight[c] (cpu_norm's kernel on that chunk, the same bits), zeros where index[i]
// is negative (-1: padding); a plain gather without weight. aux [n_src, n_aux * H] (unit stride along the row), weight [n_aux, H].
at::Tensor aux_gather(const at::Tensor& aux, const at::Tensor& index, const std::optional<at::Tensor>& weight,
                      double eps) {
  TORCH_CHECK((aux.scalar_type() == at::kFloat || aux.scalar_type() == at::kBFloat16) && aux.dim() == 2 &&
                  aux.stride(1) == 1,
              "tritonspec_cpu::aux_gather: aux must be float32 or bfloat16 [n_src, n_aux * H], unit stride along rows");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "tritonspec_cpu::aux_gather: index must be int64 [n]");
  const int64_t n = index.size(0), C = aux.size(1), src = aux.size(0);
  int64_t n_aux = 1, H = C;
  if (weight) {
    TORCH_CHECK(weight->scalar_type() == aux.scalar_type() && weight->dim() == 2 && weight->is_contiguous() &&
                    weight->size(0) * weight->size(1) == C,
                "tritonspec_cpu::aux_gather: weight must be a contiguous [n_aux, H] tensor of aux's dtype with "
                "n_aux * H = ", C);
    n_aux = weight->size(0);
    H = weight->size(1);
  }
  const at::Tensor ic = index.contiguous();
  const int64_t* idx = ic.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(idx[i] < src, "tritonspec_cpu::aux_gather: index ", idx[i], " outside [-1, ", src, ")");
  at::Tensor out = at::empty({n, C}, aux.options());
  const int64_t es = aux.element_size(), ld = aux.stride(0);
  char* o = static_cast<char*>(out.data_ptr());
  const char* a = static_cast<const char*>(aux.const_data_ptr());
  for (int64_t i = 0; i < n; i++) {
    char* row = o + i * C * es;
    if (idx[i] < 0) {
      std::fill(row, row + C * es, char(0));
      continue;
    }
    const char* in = a + idx[i] * ld * es;
    if (!weight) {
      std::copy(in, in + C * es, row);
      continue;
    }
    for (int64_t c = 0; c < n_aux; c++) {
      if (aux.scalar_type() == at::kFloat)
        tritonspec_rms_norm_f32(reinterpret_cast<const float*>(in) + c * H, H, nullptr, 0,
                                weight->const_data_ptr<float>() + c * H, 1, H, float(eps),
                                reinterpret_cast<float*>(row) + c * H, nullptr, 1);
      else
        tritonspec_rms_norm_bf16(reinterpret_cast<const uint16_t*>(in) + c * H, H, nullptr, 0,
                                 reinterpret_cast<const uint16_t*>(weight->const_data_ptr<c10::BFloat16>()) + c * H, 1,
                                 H, float(eps), reinterpret_cast<uint16_t*>(row) + c * H, nullptr, 1);
    }
  }
  return out;
}

// rope_kv.c: y = x * cos + rotate_half(x) * sin, rounded as PyTorch's eager ops (x [B, Q, H, D], unit stride along
// D; cos, sin [B, Q, D] or [B, Q, 1, D], unit stride along D). Returns [B, Q, H, D] contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "tritonspec_cpu::rope takes float32 or bfloat16 x, cos and sin of one dtype");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, "tritonspec_cpu::rope: x [B, Q, H, D], D even");
  const int64_t B = x.size(0), Q = x.size(1), H = x.size(2), D = x.size(3);
  at::Tensor c = cos.reshape({B, Q, D}), s = sin.reshape({B, Q, D});
  TORCH_CHECK(c.stride(2) == 1 && s.stride(2) == 1 && c.strides() == s.strides(),
              "tritonspec_cpu::rope: cos and sin must share strides with unit stride along D");
  at::Tensor y = at::empty({B, Q, H, D}, x.options());
  if (y.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    tritonspec_rope_f32(x.const_data_ptr<float>(), B, Q, H, D, x.stride(0), x.stride(1), x.stride(2),
                        c.const_data_ptr<float>(), s.const_data_ptr<float>(), c.stride(0), c.stride(1),
                        y.mutable_data_ptr<float>());
  } else {
    auto c16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<c10::BFloat16>()); };
    tritonspec_rope_bf16(c16(x), B, Q, H, D, x.stride(0), x.stride(1), x.stride(2), c16(c), c16(s), c.stride(0),
                         c.stride(1), reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()));
  }
  return y;
}

// rope_kv.c: cache[b, slots[b, i]] = src[b, i] (slot -1: the trash slot S - 1), in place; cache [B_max, S, Hkv, D]
// and src [B, Q, Hkv, D] of one dtype, (Hkv, D) contiguous in both.
void kv_write(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& src) {
  TORCH_CHECK(cache.dim() == 4 && src.dim() == 4 && cache.scalar_type() == src.scalar_type() &&
                  cache.size(2) == src.size(2) && cache.size(3) == src.size(3) && cache.size(0) >= src.size(0),
              "tritonspec_cpu::kv_write: cache [B_max, S, Hkv, D] and k/v [B, Q, Hkv, D] of one dtype");
  const int64_t D = src.size(3), H = src.size(2);
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == D && src.stride(3) == 1 && src.stride(2) == D,
              "tritonspec_cpu::kv_write: heads and head dim must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == src.size(0) &&
                  slots.size(1) == src.size(1),
              "tritonspec_cpu::kv_write: slots must be a contiguous int64 [B, Q] tensor");
  const int64_t bad = tritonspec_kv_write(
      static_cast<char*>(cache.data_ptr()), cache.stride(0), cache.stride(1), cache.size(1),
      static_cast<const char*>(src.const_data_ptr()), src.stride(0), src.stride(1), slots.const_data_ptr<int64_t>(),
      src.size(0), src.size(1), H * D * cache.element_size(), cache.element_size());
  TORCH_CHECK(bad == 0, "tritonspec_cpu::kv_write: ", bad, " slot(s) outside [-1, ", cache.size(1), ")");
}

void kv_write2(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  kv_write(k_cache, slots, k);
  kv_write(v_cache, slots, v);
}

// tree_ops.c: the round's index bookkeeping (kernels/cpu_tree.py), exact to its PyTorch references.
at::Tensor i64(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == dim, "tritonspec_cpu: ", what, " must be a ", dim,
              "-d int64 tensor");
  return t.contiguous();
}
at::Tensor u8(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == dim, "tritonspec_cpu: ", what, " must be a ", dim,
              "-d bool tensor");
  return t.contiguous();
}
const uint8_t* cbytes(const at::Tensor& t) { return reinterpret_cast<const uint8_t*>(t.const_data_ptr<bool>()); }
uint8_t* bytes(at::Tensor& t) { return reinterpret_cast<uint8_t*>(t.mutable_data_ptr<bool>()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_greedy(const at::Tensor& tokens, const at::Tensor& parents,
                                                             const at::Tensor& argmax, int64_t max_depth) {
  at::Tensor t = i64(tokens, "tokens", 2), p = i64(parents, "parents", 2), a = i64(argmax, "argmax", 2);
  const int64_t B = t.size(0), N = t.size(1);
  TORCH_CHECK(p.sizes() == t.sizes() && a.sizes() == t.sizes() && N >= 1 && max_depth >= 0,
              "tritonspec_cpu::verify_greedy: tokens, parents and argmax [B, N >= 1], max_depth >= 0");
  at::Tensor nodes = at::empty({B, max_depth + 1}, t.options()), num = at::empty({B}, t.options());
  at::Tensor emitted = at::empty({B, max_depth + 1}, t.options());
  tritonspec_verify_greedy(t.const_data_ptr<int64_t>(), p.const_data_ptr<int64_t>(), a.const_data_ptr<int64_t>(), B,
                           N, max_depth, nodes.mutable_data_ptr<int64_t>(), num.mutable_data_ptr<int64_t>(),
                           emitted.mutable_data_ptr<int64_t>());
  return {nodes, num, emitted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree(const at::Tensor& keep, const at::Tensor& cand_parent,
                                                          const at::Tensor& cand_depth, int64_t max_depth) {
  at::Tensor k = i64(keep, "keep", 2), cp = i64(cand_parent, "cand_parent", 2), cd = i64(cand_depth, "cand_depth", 1);
  const int64_t B = k.size(0), K1 = k.size(1), C = cp.size(1), N = K1 + 1;
  TORCH_CHECK(cp.size(0) == B && cd.size(0) == C, "tritonspec_cpu::build_tree: keep [B, N-1], cand_parent [B, C], ",
              "cand_depth [C]");
  const int64_t *kp = k.const_data_ptr<int64_t>(), *pp = cp.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K1; i++) TORCH_CHECK(kp[i] >= 0 && kp[i] < C, "tritonspec_cpu::build_tree: keep id ", kp[i], " outside [0, ", C, ")");
  for (int64_t i = 0; i < B * C; i++) TORCH_CHECK(pp[i] < C, "tritonspec_cpu::build_tree: parent candidate ", pp[i], " >= ", C);
  at::Tensor parents = at::empty({B, N}, k.options()), depth = at::empty({B, N}, k.options());
  at::Tensor mask = at::empty({B, N, N}, k.options().dtype(at::kBool)), scratch = at::empty({C}, k.options());
  tritonspec_build_tree(kp, pp, cd.const_data_ptr<int64_t>(), B, K1, C, max_depth, parents.mutable_data_ptr<int64_t>(),
                        depth.mutable_data_ptr<int64_t>(), bytes(mask), scratch.mutable_data_ptr<int64_t>());
  return {parents, depth, mask};
}

std::tuple<at::Tensor, at::Tensor> ngram_lookup(const at::Tensor& hist, const at::Tensor& L, int64_t num_tokens,
                                                int64_t n_max, int64_t n_min) {
  TORCH_CHECK(hist.scalar_type() == at::kLong && hist.dim() == 2, "tritonspec_cpu::ngram_lookup: hist [B, S] int64");
  at::Tensor h = hist.stride(1) == 1 ? hist : hist.contiguous(), l = i64(L, "L", 1);
  const int64_t B = h.size(0), S = h.size(1);
  TORCH_CHECK(l.size(0) == B && S >= 1 && num_tokens >= 1 && n_max >= 1, "tritonspec_cpu::ngram_lookup: hist [B, S >= 1], ",
              "L [B], num_tokens >= 1, n_max >= 1");
  const int64_t* lp = l.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) TORCH_CHECK(lp[b] < S, "tritonspec_cpu::ngram_lookup: L = ", lp[b], " >= S = ", S);
  at::Tensor chain = at::empty({B, num_tokens}, h.options()), valid = at::empty({B, num_tokens}, h.options().dtype(at::kBool));
  tritonspec_ngram_lookup(h.const_data_ptr<int64_t>(), h.stride(0), lp, B, S, num_tokens, n_max, n_min,
                          chain.mutable_data_ptr<int64_t>(), bytes(valid));
  return {chain, valid};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> graft_chain(
    const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& depth, const at::Tensor& mask,
    const at::Tensor& chain, const at::Tensor& valid) {
  at::Tensor t = i64(tokens, "tokens", 2), p = i64(parents, "parents", 2), d = i64(depth, "depth", 2);
  at::Tensor m = u8(mask, "mask", 3), c = i64(chain, "chain", 2), v = u8(valid, "valid", 2);
  const int64_t B = t.size(0), N = t.size(1), M = c.size(1), T = N + M;
  TORCH_CHECK(p.sizes() == t.sizes() && d.sizes() == t.sizes() && m.size(0) == B && m.size(1) == N && m.size(2) == N &&
                  c.size(0) == B && v.sizes() == c.sizes() && N >= 1 && M >= 1,
              "tritonspec_cpu::graft_chain: tokens, parents, depth [B, N >= 1], mask [B, N, N], chain and valid [B, M >= 1]");
  at::Tensor tok = at::empty({B, T}, t.options()), par = at::empty({B, T}, t.options()), dep = at::empty({B, T}, t.options());
  at::Tensor out = at::empty({B, T, T}, m.options()), added = at::empty({B}, t.options()), on = at::empty({N}, m.options());
  tritonspec_graft_chain(t.const_data_ptr<int64_t>(), p.const_data_ptr<int64_t>(), d.const_data_ptr<int64_t>(), cbytes(m),
                         c.const_data_ptr<int64_t>(), cbytes(v), B, N, M, tok.mutable_data_ptr<int64_t>(),
                         par.mutable_data_ptr<int64_t>(), dep.mutable_data_ptr<int64_t>(), bytes(out),
                         added.mutable_data_ptr<int64_t>(), bytes(on));
  return {tok, par, dep, out, added};
}

// Elements per cache slot when every slot's values are contiguous (the trailing dims, and the slot stride equal to
// them), else -1.
int64_t slot_elems(const at::Tensor& c) {
  int64_t row = 1;
  for (int64_t d = c.dim() - 1; d >= 3; d--) {
    if (c.stride(d) != row) return -1;
    row *= c.size(d);
  }
  return c.stride(2) == row ? row : -1;
}

void kv_compact(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& start, const at::Tensor& nodes) {
  at::Tensor st = i64(start, "start", 1), nd = i64(nodes, "nodes", 2);
  const int64_t B = nd.size(0), W = nd.size(1);
  TORCH_CHECK(st.size(0) == B, "tritonspec_cpu::kv_compact: start [B] and nodes [B, W]");
  TORCH_CHECK(k_cache.dim() >= 4 && k_cache.size(1) >= B && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "tritonspec_cpu::kv_compact: caches [L, B_max >= B, S, ...] of one shape and dtype");
  const int64_t row = slot_elems(k_cache);  // both layouts checked before either cache is written
  TORCH_CHECK(row >= 0 && slot_elems(v_cache) == row, "tritonspec_cpu::kv_compact: each slot's values must be contiguous");
  at::Tensor tmp = at::empty({std::max<int64_t>(W, 1) * row}, k_cache.options());
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    const int64_t bad = tritonspec_kv_compact(static_cast<char*>(c->data_ptr()), c->stride(0), c->stride(1), c->stride(2),
                                              c->size(0), B, c->size(2), st.const_data_ptr<int64_t>(),
                                              nd.const_data_ptr<int64_t>(), W, row * c->element_size(),
                                              c->element_size(), static_cast<char*>(tmp.data_ptr()));
    TORCH_CHECK(bad == 0, "tritonspec_cpu::kv_compact: ", bad, " path slot(s) outside [0, ", c->size(2), ")");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_chain(const at::Tensor& tokens, const at::Tensor& probs,
                                                            const at::Tensor& draft_probs, const at::Tensor& uniforms,
                                                            const at::Tensor& exp_noise) {
  at::Tensor t = i64(tokens, "tokens", 2);
  const int64_t B = t.size(0), N = t.size(1);
  TORCH_CHECK(N >= 1 && probs.dim() == 3 && probs.size(0) == B && probs.size(1) == N, "tritonspec_cpu::verify_chain: ",
              "tokens [B, N >= 1] and probs [B, N, V]");
  const int64_t V = probs.size(2);
  TORCH_CHECK(draft_probs.sizes() == at::IntArrayRef({B, N - 1, V}) && uniforms.sizes() == at::IntArrayRef({B, N}) &&
                  exp_noise.sizes() == at::IntArrayRef({B, V}) && V >= 1,
              "tritonspec_cpu::verify_chain: draft_probs [B, N - 1, V], uniforms [B, N], exp_noise [B, V >= 1]");
  for (const at::Tensor* x : {&probs, &draft_probs, &uniforms, &exp_noise})
    TORCH_CHECK(x->scalar_type() == at::kFloat, "tritonspec_cpu::verify_chain: probabilities and noise must be float32");
  const int64_t* tk = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < B * N; i++)
    TORCH_CHECK(tk[i] >= 0 && tk[i] < V, "tritonspec_cpu::verify_chain: token ", tk[i], " is outside [0, ", V, ")");
  at::Tensor p = probs.contiguous(), q = draft_probs.contiguous(), u = uniforms.contiguous(), xi = exp_noise.contiguous();
  at::Tensor nodes = at::empty({B, N}, t.options()), num = at::empty({B}, t.options()), emitted = at::empty({B, N}, t.options());
  tritonspec_verify_chain(t.const_data_ptr<int64_t>(), p.const_data_ptr<float>(), q.const_data_ptr<float>(),
                          u.const_data_ptr<float>(), xi.const_data_ptr<float>(), B, N, V, nodes.mutable_data_ptr<int64_t>(),
                          num.mutable_data_ptr<int64_t>(), emitted.mutable_data_ptr<int64_t>());
  return {nodes, num, emitted};
}

// RowRandom.draw's round (runtime/sampling.py) as one operator: RowRandom.hashes' words h [B, n + vocab] (tree_ops.c), the uniforms
// u = float32(h >> 8) * 2^-24 [B, n] and the noise e = max(float32(-log((h + 0.5) * 2^-32)), FLT_MIN) [B, vocab]
// (the float64 log by ATen on the same contiguous [B, vocab] tensor the Python draw builds, the rest exact IEEE
// operations: the same bits), then counter += 1 in place. Replaces ~12 tensor ops a draw (~40 us on the demo's
// 4,096-token vocabulary).
std::tuple<at::Tensor, at::Tensor> row_random(const at::Tensor& key, const at::Tensor& counter, int64_t n,
                                              int64_t vocab) {
  at::Tensor k = i64(key, "key", 1), c = i64(counter, "counter", 1);
  TORCH_CHECK(c.size(0) == k.size(0) && n >= 0 && vocab >= 0,
              "tritonspec_cpu::row_random: key and counter [B], n, vocab >= 0");
  const int64_t B = k.size(0), W = n + vocab;
  std::vector<int64_t> h(B * W);
  tritonspec_row_hash(k.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>(), B, n, vocab, h.data());
  at::Tensor u = at::empty({B, n}, k.options().dtype(at::kFloat));
  at::Tensor d = at::empty({B, vocab}, k.options().dtype(at::kDouble));
  float* up = u.mutable_data_ptr<float>();
  double* dp = d.mutable_data_ptr<double>();
  for (int64_t b = 0; b < B; b++) {
    for (int64_t j = 0; j < n; j++) up[b * n + j] = (float)(h[b * W + j] >> 8) * 0x1p-24f;
    for (int64_t j = 0; j < vocab; j++) dp[b * vocab + j] = ((double)h[b * W + n + j] + 0.5) * 0x1p-32;
  }
  d.log_();
  at::Tensor e = at::empty({B, vocab}, u.options());
  float* ep = e.mutable_data_ptr<float>();
  for (int64_t i = 0; i < B * vocab; i++) ep[i] = std::max((float)(-dp[i]), FLT_MIN);
  counter.add_(1);
  return {u, e};
}

// x [..., V] float32 or bfloat16 -> [...] int64: torch.argmax(x, -1) exactly (tree_ops.c tritonspec_argmax), the rows
// split over the intra-op threads.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "tritonspec_cpu::argmax: x [..., V >= 1], float32 or bfloat16");
  at::Tensor c = x.contiguous();
  const int64_t V = c.size(-1), R = c.numel() / V;
  at::Tensor out = at::empty(c.sizes().slice(0, c.dim() - 1), c.options().dtype(at::kLong));
  tritonspec_argmax(c.const_data_ptr(), c.scalar_type() == at::kBFloat16, R, V, V, out.mutable_data_ptr<int64_t>(),
                    at::get_num_threads());
  return out;
}

// ---- the float32 drafter step on raw buffers (drafter_step and draft_chain's fast path) ----
// The same kernels as the wrappers above (linear.c, norm.c, rope_kv.c, attention.c), called on one work buffer
// allocated once per operator call instead of ~30 ATen tensors a step: the same calls with the same arguments
// on the same values, so the same bits. Elementwise ops keep ATen's results: SiLU is at::silu_out on the shapes
// and strides the ATen path gives it; the product, the residual add and the embedding copy are single IEEE
// operations (or copies), the same in any loop.

// float32 activations against panels [N/16, K, 16] of float32 or (weight-only) bfloat16: y [M, N] contiguous
void lin_raw(const float* x, int64_t M, int64_t ldx, const at::Tensor& w, float* y, const float* b = nullptr) {
  const int64_t N = w.size(0) * 16, K = w.size(1);
  const int nt = M * N * K >= kSmall ? at::get_num_threads() : 1;
  if (w.scalar_type() == at::kBFloat16) {
    const int rc = tritonspec_linear_f32_bf16_panels(
        x, M, ldx, reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>()), N, K, b, y, N, nt);
    TORCH_CHECK(rc == 0, "tritonspec_cpu: the weight-only bfloat16 kernel failed");
  } else {
    tritonspec_linear_f32_panels(x, M, ldx, w.const_data_ptr<float>(), N, K, b, y, N, nt);
  }
}

// Whether the raw path takes a step on these: float32 activations, embedding, norms, rope tables and caches;
// projections packed into panels of float32 or bfloat16 (what the ATen path's checks also want, dtype aside).
bool raw_ok(const at::Tensor& x, const at::Tensor& embed, std::initializer_list<const at::Tensor*> f32,
            std::initializer_list<const at::Tensor*> panels) {
  if (x.scalar_type() != at::kFloat || embed.scalar_type() != at::kFloat || embed.dim() != 2 || !embed.is_contiguous())
    return false;
  for (const at::Tensor* t : f32)
    if (t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  for (const at::Tensor* w : panels)
    if (w->dim() != 3 || w->size(2) != 16 || !w->is_contiguous() ||
        (w->scalar_type() != at::kFloat && w->scalar_type() != at::kBFloat16))
      return false;
  return true;
}

struct RawStep {  // one step's weights, caches and shapes
  const at::Tensor &embed, &in_norm, &hidden_norm, &qkv_w, &o_w, &post_norm, &gate_up_w, &down_w, &final_norm;
  const at::Tensor &cos_table, &sin_table, &k_cache, &v_cache;
  double eps, scale;
  int64_t kv_len, num_heads, num_kv_heads, head_dim;
  bool norm_before_residual;
};

struct RawBufs {  // the work buffer of R = B * Q rows; gu/act/gate as tensors for at::silu_out
  at::Tensor buf, gu, act, gate;
  float *en, *vn, *z, *qkv, *qr, *kr, *o, *o2, *x, *r, *down;
  int64_t H, I, W, hq, hkv;
  RawBufs(const RawStep& p, int64_t B, int64_t Q) {
    H = p.final_norm.size(0);
    I = p.down_w.size(1);
    hq = p.num_heads * p.head_dim;
    hkv = p.num_kv_heads * p.head_dim;
    W = hq + 2 * hkv;
    // the raw kernels trust these shapes (the ATen wrappers check them call by call): checked once here
    const bool shapes = p.qkv_w.size(0) * 16 == W && p.qkv_w.size(1) == 2 * H && p.o_w.size(0) * 16 == H &&
                        p.o_w.size(1) == hq && p.gate_up_w.size(0) * 16 == 2 * I && p.gate_up_w.size(1) == H &&
                        p.down_w.size(0) * 16 == H && p.embed.size(1) == H && p.cos_table.dim() == 2 &&
                        p.cos_table.size(1) == p.head_dim && p.sin_table.sizes() == p.cos_table.sizes();
    TORCH_CHECK(shapes, "tritonspec_cpu: drafter weights that do not fit hidden ", H, ", ", p.num_heads, " + 2 x ",
                p.num_kv_heads, " heads of ", p.head_dim, " and intermediate ", I);
    for (const at::Tensor* n : {&p.in_norm, &p.hidden_norm, &p.post_norm, &p.final_norm})
      TORCH_CHECK(n->numel() == H, "tritonspec_cpu: a norm weight of ", n->numel(), " for hidden ", H);
    for (const at::Tensor* c : {&p.k_cache, &p.v_cache})
      TORCH_CHECK(c->dim() == 4 && c->size(0) >= B && c->size(2) == p.num_kv_heads && c->size(3) == p.head_dim &&
                      c->stride(3) == 1 && c->stride(2) == p.head_dim && c->scalar_type() == at::kFloat,
                  "tritonspec_cpu: the draft caches must be float32 [>= ", B, ", S, ", p.num_kv_heads, ", ",
                  p.head_dim, "] with contiguous heads");
    const int64_t R = B * Q;
    const int64_t sizes[] = {H, H, 2 * H, W, hq, hkv, hq, H, H, H, H};
    int64_t total = 0;
    for (int64_t s : sizes) total += R * s;
    buf = at::empty({total}, p.final_norm.options());
    float* at_ = buf.mutable_data_ptr<float>();
    float** ptrs[] = {&en, &vn, &z, &qkv, &qr, &kr, &o, &o2, &x, &r, &down};
    for (int i = 0; i < 11; i++) {
      *ptrs[i] = at_;
      at_ += R * sizes[i];
    }
    gu = at::empty({B, Q, 2 * I}, buf.options());  // the gate/up projection, its gate half a strided view
    act = at::empty({B, Q, I}, buf.options());
    gate = gu.narrow(-1, 0, I);
  }
};

// One layer's float32 cache [B_max, S, Hkv, D] on raw pointers, strides in elements (row, slot, head).
struct RawCache {
  char *k, *v;
  int64_t kb, ks, kh, vb, vs, vh, S;
};

// The attention half of a layer on raw buffers (raw_step, target_step): rope on q and k at each row's position
// (the table rows), the K/V write at slots, tree attention over the slots below kv_len. qkv [R, W] = q | k | v
// rows (R = B x Q); writes qr [R, Hq D], kr [R, Hkv D] and att [R, Hq D]. The wrappers' calls, so their bits.
void raw_attention(const float* qkv, int64_t B, int64_t Q, int64_t nh, int64_t nkv, int64_t D, const float* ct,
                   const float* st, const int64_t* positions, const RawCache& c, const int64_t* slots, int64_t kv_len,
                   const int64_t* prefix_lens, const uint8_t* mask, int64_t smb, int64_t smq, int64_t smt, int64_t T,
                   float scale, int nt, float* qr, float* kr, float* att) {
  const int64_t R = B * Q, hq = nh * D, hkv = nkv * D, W = hq + 2 * hkv, es = sizeof(float);
  for (int64_t i = 0; i < R; i++) {
    const float* cr = ct + positions[i] * D;
    const float* sr = st + positions[i] * D;
    tritonspec_rope_f32(qkv + i * W, 1, 1, nh, D, 0, 0, D, cr, sr, 0, 0, qr + i * hq);
    tritonspec_rope_f32(qkv + i * W + hq, 1, 1, nkv, D, 0, 0, D, cr, sr, 0, 0, kr + i * hkv);
  }
  int64_t bad = tritonspec_kv_write(c.k, c.kb, c.ks, c.S, reinterpret_cast<const char*>(kr), Q * hkv, hkv, slots, B, Q,
                                    hkv * es, es);
  bad += tritonspec_kv_write(c.v, c.vb, c.vs, c.S, reinterpret_cast<const char*>(qkv + hq + hkv), Q * W, W, slots, B, Q,
                             hkv * es, es);
  TORCH_CHECK(bad == 0, "tritonspec_cpu::kv_write: ", bad, " slot(s) outside [-1, ", c.S, ")");
  const int64_t Sv = std::min<int64_t>(kv_len >= 0 ? kv_len : c.S, c.S);
  const int rc = tritonspec_tree_attention_f32(
      qr, B, Q, nh, D, Q * hq, hq, D, reinterpret_cast<const float*>(c.k), reinterpret_cast<const float*>(c.v), nkv,
      c.kb, c.ks, c.kh, c.vb, c.vs, c.vh, prefix_lens, mask, smb, smq, smt, T, Sv, scale, att, nt);
  TORCH_CHECK(rc != -2, "tritonspec_cpu::tree_attention: out of memory for the shared-prefix scratch");
  TORCH_CHECK(rc == 0, "tritonspec_cpu::tree_attention: unsupported head shape");
}

// One float32 drafter step over R = B x Q rows (Eagle3Drafter.step's math, drafter_step's order of calls):
// hidden [R, H] rows at stride H, tokens, positions and slots [R] int64, prefix_lens [B], the mask [B, Q, T]
// at strides (smb, smq, smt); writes h and hn [R, H]. hidden may be h or hn of the previous step (read before
// they are written).
void raw_step(const RawStep& p, RawBufs& w, const float* hidden, const int64_t* tokens, const int64_t* positions,
              const int64_t* slots, const int64_t* prefix_lens, const uint8_t* mask, int64_t smb, int64_t smq,
              int64_t smt, int64_t T, int64_t B, int64_t Q, float* h, float* hn) {
  const int64_t R = B * Q, H = w.H, I = w.I, W = w.W, D = p.head_dim, V = p.embed.size(0);
  const int64_t npos = p.cos_table.size(0);
  const float eps = float(p.eps);
  const int nt = at::get_num_threads();
  const float* E = p.embed.const_data_ptr<float>();
  for (int64_t i = 0; i < R; i++) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < V, "tritonspec_cpu: token id ", tokens[i], " outside the embedding [0, ",
                V, ")");
    TORCH_CHECK(positions[i] >= 0 && positions[i] < npos, "tritonspec_cpu: position ", positions[i],
                " outside the rope table [0, ", npos, ")");
  }
  float* e = w.o2;  // the embedding rows, before o2 is needed
  for (int64_t i = 0; i < R; i++) std::copy(E + tokens[i] * H, E + (tokens[i] + 1) * H, e + i * H);
  tritonspec_rms_norm_f32(e, H, nullptr, 0, p.in_norm.const_data_ptr<float>(), R, H, eps, w.en, nullptr, nt);
  tritonspec_rms_norm_f32(hidden, H, nullptr, 0, p.hidden_norm.const_data_ptr<float>(), R, H, eps, w.vn, nullptr, nt);
  for (int64_t i = 0; i < R; i++) {  // z = [e; v]: embedding first, hidden second
    std::copy(w.en + i * H, w.en + (i + 1) * H, w.z + i * 2 * H);
    std::copy(w.vn + i * H, w.vn + (i + 1) * H, w.z + i * 2 * H + H);
  }
  lin_raw(w.z, R, 2 * H, p.qkv_w, w.qkv);
  const at::Tensor &kc = p.k_cache, &vc = p.v_cache;
  const RawCache cache{static_cast<char*>(kc.data_ptr()), static_cast<char*>(vc.data_ptr()), kc.stride(0), kc.stride(1),
                       kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), kc.size(1)};
  raw_attention(w.qkv, B, Q, p.num_heads, p.num_kv_heads, D, p.cos_table.const_data_ptr<float>(),
                p.sin_table.const_data_ptr<float>(), positions, cache, slots, p.kv_len, prefix_lens, mask, smb, smq,
                smt, T, float(p.scale), nt, w.qr, w.kr, w.o);
  lin_raw(w.o, R, w.hq, p.o_w, w.o2);
  tritonspec_rms_norm_f32(w.o2, H, p.norm_before_residual ? w.vn : hidden, H, p.post_norm.const_data_ptr<float>(), R,
                          H, eps, w.x, w.r, nt);
  float* gu = w.gu.mutable_data_ptr<float>();
  lin_raw(w.x, R, H, p.gate_up_w, gu);
  at::silu_out(w.act, w.gate);
  float* act = w.act.mutable_data_ptr<float>();
  for (int64_t i = 0; i < R; i++)
    for (int64_t j = 0; j < I; j++) act[i * I + j] *= gu[i * 2 * I + I + j];
  lin_raw(act, R, I, p.down_w, w.down);
  for (int64_t i = 0; i < R * H; i++) h[i] = w.r[i] + w.down[i];
  tritonspec_rms_norm_f32(h, H, nullptr, 0, p.final_norm.const_data_ptr<float>(), R, H, eps, hn, nullptr, nt);
}

// One EAGLE-3 drafter step (runtime/drafter.py Eagle3Drafter.step, decode rounds: not a prompt's causal forward)
// as one operator: the same wrappers and ATen calls the Python step makes, in the same order with the same
// arguments, so the same bits, without ~20 Python-level dispatches (~0.3 ms a step on the demo drafter).
// Projections packed into panels (cpu_linear.pack_panels: qkv and gate_up fused), the rope tables
// [max_pos, D] gathered at positions [B, Q]. Returns (hn, h): the final norm's output and its input.
std::tuple<at::Tensor, at::Tensor> drafter_step(
    const at::Tensor& hidden, const at::Tensor& tokens, const at::Tensor& embed, const at::Tensor& in_norm,
    const at::Tensor& hidden_norm, const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& post_norm,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& final_norm, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double eps, double scale,
    int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool norm_before_residual) {
  TORCH_CHECK(hidden.dim() == 3 && tokens.dim() == 2 && tokens.size(0) == hidden.size(0) &&
                  tokens.size(1) == hidden.size(1) && positions.sizes() == tokens.sizes(),
              "tritonspec_cpu::drafter_step: hidden [B, Q, H], tokens and positions [B, Q]");
  for (const at::Tensor* w : {&qkv_w, &o_w, &gate_up_w, &down_w})
    TORCH_CHECK(w->dim() == 3, "tritonspec_cpu::drafter_step: projections packed into panels (cpu_linear.pack_panels)");
  const int64_t B = hidden.size(0), Q = hidden.size(1), D = head_dim;
  const int64_t hq = num_heads * D, hkv = num_kv_heads * D;
  const std::optional<at::Tensor> none;
  if (raw_ok(hidden, embed, {&in_norm, &hidden_norm, &post_norm, &final_norm, &cos_table, &sin_table},
             {&qkv_w, &o_w, &gate_up_w, &down_w}) &&
      k_cache.scalar_type() == at::kFloat && embed.size(1) == hidden.size(2) && tree_mask.scalar_type() == at::kBool &&
      tree_mask.dim() == 3 && tree_mask.size(0) == B && tree_mask.size(1) == Q && tokens.scalar_type() == at::kLong &&
      positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && slots.sizes() == tokens.sizes() &&
      prefix_lens.scalar_type() == at::kLong && prefix_lens.numel() == B) {  // float32: the same calls on raw buffers
    const RawStep p{embed,     in_norm,   hidden_norm, qkv_w,   o_w,    post_norm, gate_up_w,
                    down_w,    final_norm, cos_table,  sin_table, k_cache, v_cache,  eps,
                    scale,     kv_len,    num_heads,   num_kv_heads, head_dim, norm_before_residual};
    RawBufs w(p, B, Q);
    const at::Tensor hc = hidden.contiguous(), tc = tokens.contiguous(), pc = positions.contiguous();
    const at::Tensor sc = slots.contiguous(), lc = prefix_lens.contiguous();
    at::Tensor h = at::empty(hidden.sizes(), hidden.options()), hn = at::empty(hidden.sizes(), hidden.options());
    raw_step(p, w, hc.const_data_ptr<float>(), tc.const_data_ptr<int64_t>(), pc.const_data_ptr<int64_t>(),
             sc.const_data_ptr<int64_t>(), lc.const_data_ptr<int64_t>(), cbytes(tree_mask), tree_mask.stride(0),
             tree_mask.stride(1), tree_mask.stride(2), tree_mask.size(2), B, Q, h.mutable_data_ptr<float>(),
             hn.mutable_data_ptr<float>());
    return {hn, h};
  }
  at::Tensor e = at::embedding(embed, tokens).to(hidden.scalar_type());
  e = std::get<0>(rms_norm(e, in_norm, eps, none, -1));
  at::Tensor v = std::get<0>(rms_norm(hidden, hidden_norm, eps, none, -1));
  at::Tensor z = at::cat({e, v}, -1);  // [B, Q, 2H]: embedding first, hidden second
  at::Tensor qkv = linear(z, qkv_w, none, -1);
  TORCH_CHECK(qkv.size(-1) == hq + 2 * hkv, "tritonspec_cpu::drafter_step: the qkv weight has ", qkv.size(-1),
              " outputs for ", num_heads, " + 2 x ", num_kv_heads, " heads of ", D);
  at::Tensor q = qkv.narrow(-1, 0, hq).view({B, Q, num_heads, D});
  at::Tensor k = qkv.narrow(-1, hq, hkv).view({B, Q, num_kv_heads, D});
  at::Tensor val = qkv.narrow(-1, hq + hkv, hkv).contiguous().view({B, Q, num_kv_heads, D});
  const at::Tensor flat = positions.reshape({-1});
  at::Tensor cos = cos_table.index_select(0, flat).view({B, Q, 1, D});
  at::Tensor sin = sin_table.index_select(0, flat).view({B, Q, 1, D});
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  kv_write(k_cache, slots, k);
  kv_write(v_cache, slots, val);
  at::Tensor o = tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, -1);
  o = linear(o.reshape({B, Q, -1}), o_w, none, -1);
  auto xr = rms_norm(o, post_norm, eps, norm_before_residual ? v : hidden, -1);
  at::Tensor gu = linear(std::get<0>(xr), gate_up_w, none, -1);
  auto gates = gu.chunk(2, -1);
  at::Tensor h = std::get<1>(xr).add(linear(at::silu(gates[0]).mul(gates[1]), down_w, none, -1));
  at::Tensor hn = std::get<0>(rms_norm(h, final_norm, eps, none, -1));
  return {hn, h};
}

// draft_chain's float32 path: the same chain on raw buffers. Each depth's pick is the first largest logit of the
// head (argmax of log_softmax's input: the same token as the top-1 of log q wherever that top-1 is unique;
// log_softmax only subtracts one constant per row), a NaN first if any (at::topk ranks NaN above numbers).
// Sampled (xi defined, draft_chain_sampled): each depth's pick is Decoder._draft_sampled_chain's exponential race,
// argmax(log_softmax(logits / temperature) - log xi[:, s]): log q by the same ATen calls on the head's logits (no
// division at temperature 1, as process_logits), log xi by one ATen log of the whole xi (as the Python loop takes
// it), the difference and its first maximum (a NaN first) in C; the log q row is written into lps [B, n, Vd].
at::Tensor draft_chain_raw(const at::Tensor& hn0, const at::Tensor& carry0, const at::Tensor& head_w,
                           const at::Tensor& d2t, const at::Tensor& L, const at::Tensor& active, const RawStep& p,
                           bool norm_output, int64_t n, const at::Tensor& xi = at::Tensor(), double temperature = 1.0,
                           at::Tensor* lps = nullptr) {
  const int64_t B = hn0.size(0), H = hn0.size(1), width = std::max<int64_t>(n - 1, 1), Vd = head_w.size(0) * 16;
  TORCH_CHECK(head_w.size(1) == H && d2t.numel() == Vd, "tritonspec_cpu::draft_chain: the head [", Vd, ", ",
              head_w.size(1), "] and d2t [", d2t.numel(), "] do not fit hidden ", H);
  RawBufs w(p, B, 1);
  at::Tensor toks = at::empty({B, n}, L.options());
  at::Tensor fmask = at::zeros({B, 1, width}, L.options().dtype(at::kBool));
  // logits [B, Vd], h and hn [B, H]; the step's token, position and slot [B] (int64)
  at::Tensor fbuf = at::empty({B * (Vd + 2 * H)}, hn0.options());
  at::Tensor ibuf = at::empty({3 * B}, L.options());
  float* logits = fbuf.mutable_data_ptr<float>();
  float *h = logits + B * Vd, *hn = h + B * H;
  int64_t *tok = ibuf.mutable_data_ptr<int64_t>(), *pos = tok + B, *slot = pos + B;
  int64_t* out = toks.mutable_data_ptr<int64_t>();
  uint8_t* fm = bytes(fmask);
  const int64_t* l = L.const_data_ptr<int64_t>();
  const bool* act = active.const_data_ptr<bool>();
  const int64_t* d2 = d2t.const_data_ptr<int64_t>();
  const at::Tensor hc = hn0.contiguous(), cc = carry0.contiguous();
  const float* hid = cc.const_data_ptr<float>();
  const at::Tensor lg = at::from_blob(logits, {B, Vd}, hn0.options());  // a view of the logits buffer
  lin_raw(hc.const_data_ptr<float>(), B, H, head_w, logits);
  const at::Tensor lxi = xi.defined() ? xi.contiguous().log() : at::Tensor();  // [B, >= n, Vd]
  for (int64_t s = 0; s < n; s++) {
    if (xi.defined()) {  // the race on log q (process_logits at top_k = 0, top_p = 1, then log_softmax)
      const at::Tensor lp = at::log_softmax(temperature == 1.0 ? lg : lg.div(temperature), -1);  // [B, Vd]
      lps->select(1, s).copy_(lp);
      const float* lq = lp.const_data_ptr<float>();
      const float* lx = lxi.const_data_ptr<float>() + s * Vd;
      for (int64_t b = 0; b < B; b++) {
        const float *qr = lq + b * Vd, *xr = lx + b * lxi.size(1) * Vd;
        int64_t best = 0;
        float top = qr[0] - xr[0];
        for (int64_t j = 1; j < Vd && top == top; j++) {  // stops at a NaN
          const float v = qr[j] - xr[j];
          if (v > top || v != v) best = j, top = v;
        }
        tok[b] = best + d2[best];
        out[b * n + s] = tok[b];
      }
    } else {
      for (int64_t b = 0; b < B; b++) {
        const float* row = logits + b * Vd;
        int64_t best = 0;
        for (int64_t j = 1; j < Vd && row[best] == row[best]; j++)  // stops at a NaN
          if (row[j] > row[best] || row[j] != row[j]) best = j;
        tok[b] = best + d2[best];
        out[b * n + s] = tok[b];
      }
    }
    if (s == n - 1) break;
    for (int64_t b = 0; b < B; b++) {
      fm[b * width + s] = 1;  // the chain so far, this token included
      pos[b] = l[b] + s;
      slot[b] = act[b] ? pos[b] : -1;  // idle rows write nowhere
    }
    raw_step(p, w, hid, tok, pos, slot, l, fm, width, width, 1, width, B, 1, h, hn);
    hid = norm_output ? hn : h;
    lin_raw(hn, B, H, head_w, logits);
  }
  return toks;
}

// Decoder.commit's drafter catch-up of a decode round (runtime/decode.py _catch_up, float32) as one operator: the
// accepted path's target features gathered and fused (fc_norm per chunk, the optional input norm, fc), one drafter
// step over them, and each row's state at its last accepted position. index[b, j] = b * N + nodes[b, j] (-1: none),
// n_valid[b] = active[b] ? num[b] + 1 : 0, the first q columns with q = qc > 0 ? qc : max(1, max_b n_valid[b]);
// tokens max(emitted, 0) at positions L + j (slot -1 from n_valid on), a causal mask; hn_out[b] and carry_out[b]
// (norm_output: hn, else h) at column max(n_valid[b] - 1, 0). The Python path's calls on the same values, so the
// same bits. Returns false, touching nothing, where the raw float32 path does not apply (the caller then runs it).
bool catch_up(const at::Tensor& aux, const at::Tensor& nodes, const at::Tensor& emitted, const at::Tensor& num,
              const at::Tensor& active, const at::Tensor& L, int64_t N, int64_t qc, const at::Tensor& fc_w,
              const std::optional<at::Tensor>& fc_norm, const std::optional<at::Tensor>& fc_in_norm,
              const at::Tensor& embed, const at::Tensor& in_norm, const at::Tensor& hidden_norm, const at::Tensor& qkv_w,
              const at::Tensor& o_w, const at::Tensor& post_norm, const at::Tensor& gate_up_w, const at::Tensor& down_w,
              const at::Tensor& final_norm, const at::Tensor& cos_table, const at::Tensor& sin_table,
              const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& hn_out, const at::Tensor& carry_out,
              double eps, double scale, int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              bool norm_before_residual, bool norm_output) {
  const int64_t B = nodes.dim() == 2 ? nodes.size(0) : -1, W = nodes.dim() == 2 ? nodes.size(1) : 0;
  const int64_t H = final_norm.size(0), C = aux.dim() == 2 ? aux.size(1) : -1;
  if (!raw_ok(aux, embed, {&in_norm, &hidden_norm, &post_norm, &final_norm, &cos_table, &sin_table},
              {&fc_w, &qkv_w, &o_w, &gate_up_w, &down_w}) ||
      k_cache.scalar_type() != at::kFloat || v_cache.scalar_type() != at::kFloat || embed.size(1) != H ||
      !aux.is_contiguous() || B < 1 || W < 1 || fc_w.size(1) != C || fc_w.size(0) * 16 != H)
    return false;
  for (const at::Tensor* t : {&nodes, &emitted, &num, &L})
    if (t->scalar_type() != at::kLong || !t->is_contiguous()) return false;
  if (emitted.sizes() != nodes.sizes() || num.numel() != B || L.numel() != B || active.numel() != B ||
      active.scalar_type() != at::kBool || !active.is_contiguous())
    return false;
  for (const at::Tensor* t : {&hn_out, &carry_out})
    if (t->scalar_type() != at::kFloat || t->dim() != 2 || t->size(0) != B || t->size(1) != H || t->stride(1) != 1)
      return false;
  if (fc_norm && (fc_norm->scalar_type() != at::kFloat || !fc_norm->is_contiguous() || fc_norm->dim() != 2 ||
                  fc_norm->numel() != C))
    return false;
  if (fc_in_norm && (fc_in_norm->scalar_type() != at::kFloat || fc_in_norm->numel() != C)) return false;
  const int64_t* nd = nodes.const_data_ptr<int64_t>();
  const int64_t* em = emitted.const_data_ptr<int64_t>();
  const int64_t* nm = num.const_data_ptr<int64_t>();
  const int64_t* l = L.const_data_ptr<int64_t>();
  const bool* act = active.const_data_ptr<bool>();
  std::vector<int64_t> nvalid(B);
  int64_t q = 1;
  for (int64_t b = 0; b < B; b++) {
    nvalid[b] = act[b] ? nm[b] + 1 : 0;
    q = std::max(q, nvalid[b]);
  }
  q = std::min(qc > 0 ? qc : q, W);
  const int64_t R = B * q;
  std::vector<int64_t> index(R), tokens(R), positions(R), slots(R);
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < q; j++) {
      const int64_t i = b * q + j, node = nd[b * W + j];
      index[i] = node >= 0 ? b * N + node : -1;
      tokens[i] = std::max<int64_t>(em[b * W + j], 0);
      positions[i] = l[b] + j;
      slots[i] = j < nvalid[b] ? positions[i] : -1;
    }
  const at::Tensor idx = at::from_blob(index.data(), {R}, L.options());
  at::Tensor x = aux_gather(aux, idx, fc_norm, eps);
  if (fc_in_norm) x = std::get<0>(rms_norm(x, *fc_in_norm, eps, std::nullopt, -1));
  const RawStep p{embed,      in_norm,   hidden_norm, qkv_w,   o_w,     post_norm, gate_up_w,
                  down_w,     final_norm, cos_table,  sin_table, k_cache, v_cache,  eps,
                  scale,      kv_len,    num_heads,   num_kv_heads, head_dim, norm_before_residual};
  RawBufs w(p, B, q);
  at::Tensor out = at::empty({3 * R * H}, hn_out.options());  // g, h, hn [R, H]
  float *g = out.mutable_data_ptr<float>(), *h = g + R * H, *hn = h + R * H;
  lin_raw(x.const_data_ptr<float>(), R, C, fc_w, g);
  std::vector<uint8_t> mask(B * q * q);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < q; i++)
      for (int64_t j = 0; j < q; j++) mask[(b * q + i) * q + j] = j <= i;
  raw_step(p, w, g, tokens.data(), positions.data(), slots.data(), l, mask.data(), q * q, q, 1, q, B, q, h, hn);
  float* ho = hn_out.mutable_data_ptr<float>();
  float* co = carry_out.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; b++) {
    const int64_t last = b * q + std::max<int64_t>(nvalid[b] - 1, 0);
    std::copy(hn + last * H, hn + (last + 1) * H, ho + b * hn_out.stride(0));
    const float* c = norm_output ? hn : h;
    std::copy(c + last * H, c + (last + 1) * H, co + b * carry_out.stride(0));
  }
  return true;
}

// Decoder.draft's EAGLE-2 expansion for top_k = K > 1, greedy (runtime/decode.py draft: the same ATen calls on the
// same values, in the same order, and the drafter steps on raw buffers), float32: depth 1 the top K of log q at hn0;
// each depth below D one step of the K frontier nodes (position L + s - 1, slot L + (s - 1) K + k, each seeing its
// ancestors and itself), their top K children by cumulative log q, the next frontier the best K of the K^2 (stable
// sort, ties to the lower index); then the N - 1 best candidates (the same rule) built into the tree with the root.
// Returns (node_tokens [B, N], parents [B, N], depth [B, N], mask [B, N, N]), or four empty tensors where the raw
// path does not apply (the caller then runs the Python expansion).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_tree(
    const at::Tensor& hn0, const at::Tensor& carry0, const at::Tensor& head_w, const at::Tensor& d2t, const at::Tensor& L,
    const at::Tensor& active, const at::Tensor& root, const at::Tensor& embed, const at::Tensor& in_norm,
    const at::Tensor& hidden_norm, const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& post_norm,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& final_norm, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& k_cache, const at::Tensor& v_cache, double eps, double scale,
    int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool norm_before_residual,
    bool norm_output, int64_t K, int64_t D, int64_t N) {
  if (!raw_ok(hn0, embed, {&carry0, &in_norm, &hidden_norm, &post_norm, &final_norm, &cos_table, &sin_table},
              {&head_w, &qkv_w, &o_w, &gate_up_w, &down_w}) ||
      hn0.dim() != 2 || carry0.sizes() != hn0.sizes() || k_cache.scalar_type() != at::kFloat ||
      embed.size(1) != hn0.size(1) || head_w.size(1) != hn0.size(1) || d2t.scalar_type() != at::kLong ||
      L.scalar_type() != at::kLong || root.scalar_type() != at::kLong || active.scalar_type() != at::kBool ||
      !L.is_contiguous() || !active.is_contiguous() || L.numel() != hn0.size(0) || root.numel() != hn0.size(0) ||
      d2t.numel() != head_w.size(0) * 16 || K < 2 || D < 1 || N < 2)
    return {at::empty({0}, L.options()), at::empty({0}, L.options()), at::empty({0}, L.options()),
            at::empty({0}, L.options())};
  const int64_t B = hn0.size(0), H = hn0.size(1), Vd = head_w.size(0) * 16;
  const int64_t width = std::max<int64_t>((D - 1) * K, 1);
  const auto lopt = L.options();
  const RawStep p{embed,      in_norm,   hidden_norm, qkv_w,   o_w,     post_norm, gate_up_w,
                  down_w,     final_norm, cos_table,  sin_table, k_cache, v_cache,  eps,
                  scale,      kv_len,    num_heads,   num_kv_heads, head_dim, norm_before_residual};
  RawBufs w(p, B, K);
  auto ids = [&](const at::Tensor& t) {  // Eagle3Drafter.to_target_ids
    return t.add(d2t.index_select(0, t.reshape({-1})).view(t.sizes()));
  };
  at::Tensor logits = at::empty({B, Vd}, hn0.options());
  const at::Tensor hc = hn0.contiguous();
  lin_raw(hc.const_data_ptr<float>(), B, H, head_w, logits.mutable_data_ptr<float>());
  auto top = at::topk(at::log_softmax(logits, -1), K, -1);
  at::Tensor score = std::get<0>(top), tok = ids(std::get<1>(top)).contiguous();
  std::vector<at::Tensor> scores{score}, tokens{tok}, parents{at::full({B, K}, -1, lopt)}, depths{at::ones({K}, lopt)};
  at::Tensor gid = at::arange(K, lopt).expand({B, K});
  at::Tensor hid = carry0.unsqueeze(1).expand({B, K, H}).contiguous();
  at::Tensor fmask = at::zeros({B, K, width}, lopt.dtype(at::kBool));
  at::Tensor h = at::empty({B, K, H}, hn0.options()), hn = at::empty({B, K, H}, hn0.options());
  at::Tensor lg = at::empty({B, K, Vd}, hn0.options());
  std::vector<int64_t> pos(B * K), slot(B * K);
  const int64_t* l = L.const_data_ptr<int64_t>();
  const bool* act = active.const_data_ptr<bool>();
  int64_t offset = K;
  for (int64_t s = 1; s < D; s++) {
    uint8_t* fm = bytes(fmask);
    for (int64_t b = 0; b < B; b++)
      for (int64_t k = 0; k < K; k++) {
        const int64_t own = (s - 1) * K + k;
        fm[(b * K + k) * width + own] = 1;
        pos[b * K + k] = l[b] + s - 1;
        slot[b * K + k] = act[b] ? l[b] + own : -1;  // idle rows write nowhere
      }
    raw_step(p, w, hid.const_data_ptr<float>(), tok.const_data_ptr<int64_t>(), pos.data(), slot.data(), l, fm,
             K * width, width, 1, width, B, K, h.mutable_data_ptr<float>(), hn.mutable_data_ptr<float>());
    lin_raw(hn.const_data_ptr<float>(), B * K, H, head_w, lg.mutable_data_ptr<float>());
    auto sub = at::topk(at::log_softmax(lg, -1), K, -1);  // [B, K, K]
    at::Tensor cum = score.unsqueeze(2).add(std::get<0>(sub)).reshape({B, K * K});
    at::Tensor ctok = ids(std::get<1>(sub)).reshape({B, K * K});
    scores.push_back(cum);
    tokens.push_back(ctok);
    parents.push_back(gid.repeat_interleave(K, 1));
    depths.push_back(at::full({K * K}, s + 1, lopt));
    if (s == D - 1) break;
    auto best = at::sort(cum, true, -1, true);  // topk_stable: ties to the lower index
    score = std::get<0>(best).narrow(-1, 0, K);
    const at::Tensor sel = std::get<1>(best).narrow(-1, 0, K), up = at::floor_divide(sel, K);
    tok = ctok.gather(1, sel).contiguous();
    hid = (norm_output ? hn : h).gather(1, up.unsqueeze(-1).expand({B, K, H})).contiguous();
    fmask = fmask.gather(1, up.unsqueeze(-1).expand({B, K, width})).contiguous();
    gid = sel.add(offset);
    offset += K * K;
  }
  const at::Tensor all = at::cat(scores, 1);
  TORCH_CHECK(N - 1 <= all.size(1), "tritonspec_cpu::draft_tree: ", N - 1, " nodes from ", all.size(1), " candidates");
  const at::Tensor keep = std::get<0>(at::sort(std::get<1>(at::sort(all, true, -1, true)).narrow(-1, 0, N - 1), -1));
  auto tree = build_tree(keep, at::cat(parents, 1), at::cat(depths), D);
  at::Tensor node_tokens = at::cat({root.reshape({B, 1}), at::cat(tokens, 1).gather(1, keep)}, 1);
  return {node_tokens, std::get<0>(tree), std::get<1>(tree), std::get<2>(tree)};
}

// Decoder.commit's speculative bookkeeping before L and the root move (runtime/decode.py _commit_history): the
// token history hist[b, min(L[b] + j, S - 1)] = (root[b], emitted[b, 0], ..., emitted[b, W - 1])[j], j in order,
// and with n_tree > 0 the drafted count out[b, -1] = nodes[b, num[b]] < n_tree ? #{j : 0 < nodes[b, j] < n_tree}
// : -1 (adaptive shapes). In place; the integers of the PyTorch ops it replaces (~17 calls a round).
void commit_history(const at::Tensor& hist, const at::Tensor& L, const at::Tensor& root, const at::Tensor& emitted,
                    const at::Tensor& nodes, const at::Tensor& num, const at::Tensor& out, int64_t n_tree) {
  const at::Tensor l = i64(L, "L", 1), r = i64(root, "root", 1), e = i64(emitted, "emitted", 2);
  const at::Tensor nd = i64(nodes, "nodes", 2), nm = i64(num, "num", 1);
  const int64_t B = l.size(0), W = e.size(1), Wn = nd.size(1);
  TORCH_CHECK(hist.scalar_type() == at::kLong && hist.dim() == 2 && hist.size(0) >= B && hist.stride(1) == 1 &&
                  hist.size(1) > 0 && r.size(0) == B && e.size(0) == B && nd.size(0) == B && nm.size(0) == B,
              "tritonspec_cpu::commit_history: hist [>= B, S] int64, L, root and num [B], emitted and nodes [B, W]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 2 && out.size(0) >= B && out.stride(1) == 1,
              "tritonspec_cpu::commit_history: out [>= B, width] int64");
  const int64_t S = hist.size(1), hs = hist.stride(0), os = out.stride(0), ow = out.size(1);
  int64_t* h = hist.mutable_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  const int64_t *lp = l.const_data_ptr<int64_t>(), *rp = r.const_data_ptr<int64_t>();
  const int64_t *ep = e.const_data_ptr<int64_t>(), *np = nd.const_data_ptr<int64_t>(), *mp = nm.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    for (int64_t j = 0; j <= W; j++) {
      const int64_t pos = std::min<int64_t>(lp[b] + j, S - 1);
      TORCH_CHECK(pos >= 0, "tritonspec_cpu::commit_history: position ", pos, " < 0");
      h[b * hs + pos] = j == 0 ? rp[b] : ep[b * W + j - 1];
    }
    if (n_tree > 0) {
      TORCH_CHECK(mp[b] >= 0 && mp[b] < Wn, "tritonspec_cpu::commit_history: num ", mp[b], " outside [0, ", Wn, ")");
      int64_t in_tree = 0;
      for (int64_t j = 0; j < Wn; j++) in_tree += np[b * Wn + j] > 0 && np[b * Wn + j] < n_tree;
      o[b * os + ow - 1] = np[b * Wn + mp[b]] < n_tree ? in_tree : -1;
    }
  }
}

// Decoder.draft's greedy top-1 chain (runtime/decode.py: draft_chain with the tree's top-1 pick) as one operator:
// n draft tokens [B, n] (target ids) from the last catch-up state hn0, carry0 [B, H]. At depth s: log q =
// log_softmax(float(head hn)), the top-1 draft id (at::topk, as the Python pick), its target id (id + d2t[id]);
// then, below depth n, one drafter_step on that token at position L + s (slot L + s, or -1 for an idle row),
// seeing the chain so far (mask columns 0..s of width max(n - 1, 1)), whose hn (norm_output) or h feeds the next.
// The calls of the Python loop with the same arguments in the same order: the same tokens, bit for bit, without
// its ~15 Python-level calls a depth.
// draft_chain's and draft_chain_sampled's argument checks (what: the operator's name), and whether their float32
// raw-buffer path (draft_chain_raw) takes these tensors.
bool chain_raw_ok(const char* what, const at::Tensor& hn0, const at::Tensor& carry0, const at::Tensor& head_w,
                  const at::Tensor& d2t, const at::Tensor& L, const at::Tensor& active, const RawStep& p, int64_t n) {
  TORCH_CHECK(hn0.dim() == 2 && carry0.sizes() == hn0.sizes() && L.dim() == 1 && L.size(0) == hn0.size(0) &&
                  active.sizes() == L.sizes() && active.scalar_type() == at::kBool && n >= 1,
              what, ": hn0 and carry0 [B, H], L and active [B] (bool), n >= 1");
  TORCH_CHECK(head_w.dim() == 3, what, ": the head packed into panels (cpu_linear.pack_panels)");
  return raw_ok(hn0, p.embed, {&carry0, &p.in_norm, &p.hidden_norm, &p.post_norm, &p.final_norm, &p.cos_table,
                               &p.sin_table},
                {&head_w, &p.qkv_w, &p.o_w, &p.gate_up_w, &p.down_w}) &&
         p.k_cache.scalar_type() == at::kFloat && p.embed.size(1) == hn0.size(1) && d2t.is_contiguous() &&
         L.is_contiguous() && active.is_contiguous() && d2t.scalar_type() == at::kLong && L.scalar_type() == at::kLong;
}

at::Tensor draft_chain(const at::Tensor& hn0, const at::Tensor& carry0, const at::Tensor& head_w, const at::Tensor& d2t,
                       const at::Tensor& L, const at::Tensor& active, const at::Tensor& embed, const at::Tensor& in_norm,
                       const at::Tensor& hidden_norm, const at::Tensor& qkv_w, const at::Tensor& o_w,
                       const at::Tensor& post_norm, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                       const at::Tensor& final_norm, const at::Tensor& cos_table, const at::Tensor& sin_table,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, double eps, double scale, int64_t kv_len,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool norm_before_residual,
                       bool norm_output, int64_t n) {
  const RawStep p{embed,     in_norm,   hidden_norm, qkv_w,   o_w,    post_norm, gate_up_w,
                  down_w,    final_norm, cos_table,  sin_table, k_cache, v_cache,  eps,
                  scale,     kv_len,    num_heads,   num_kv_heads, head_dim, norm_before_residual};
  if (chain_raw_ok("tritonspec_cpu::draft_chain", hn0, carry0, head_w, d2t, L, active, p, n))
    return draft_chain_raw(hn0, carry0, head_w, d2t, L, active, p, norm_output, n);
  const int64_t B = hn0.size(0), width = std::max<int64_t>(n - 1, 1);
  const std::optional<at::Tensor> none;
  at::Tensor fmask = at::zeros({B, 1, width}, L.options().dtype(at::kBool));
  const at::Tensor col = at::arange(width, L.options());
  at::Tensor hid = carry0.unsqueeze(1);  // [B, 1, H]
  at::Tensor lp = at::log_softmax(linear(hn0, head_w, none, -1).to(at::kFloat), -1);  // [B, Vd]
  at::Tensor toks = at::empty({B, n}, L.options());
  for (int64_t s = 0; s < n; s++) {
    const at::Tensor idx = std::get<1>(at::topk(lp, 1, -1)).select(1, 0);  // [B] draft ids
    const at::Tensor tok = idx.add(d2t.index_select(0, idx));              // [B] target ids
    toks.select(1, s).copy_(tok);
    if (s == n - 1) break;
    fmask = fmask.bitwise_or(col.eq(s));  // the chain so far, this token included
    const at::Tensor positions = L.add(s).unsqueeze(1);
    const at::Tensor slots = at::where(active.unsqueeze(1), positions, -1);  // idle rows write nowhere
    auto out = drafter_step(hid, tok.unsqueeze(1), embed, in_norm, hidden_norm, qkv_w, o_w, post_norm, gate_up_w, down_w,
                            final_norm, cos_table, sin_table, positions, slots, k_cache, v_cache, L, fmask, eps, scale,
                            kv_len, num_heads, num_kv_heads, head_dim, norm_before_residual);
    hid = norm_output ? std::get<0>(out) : std::get<1>(out);
    lp = at::log_softmax(linear(std::get<0>(out).select(1, 0), head_w, none, -1).to(at::kFloat), -1);
  }
  return toks;
}

// Decoder._draft_sampled_chain's chain (temperature only: top_k = 0, top_p = 1) as one operator, float32 raw
// buffers only: (target ids [B, n], q [B, n, vocab]), each depth's token drawn by the exponential race on xi
// [B, n, Vd] (Exp(1) noise, RowRandom.draw's), q the draft distributions in the target's vocabulary (exp of
// log q by one ATen call on [B, n, Vd], as the Python loop's, placed at the target ids: index_add_ into zeros).
// Empty tensors where the raw path does not apply (the caller then runs its Python loop).
std::tuple<at::Tensor, at::Tensor> draft_chain_sampled(
    const at::Tensor& hn0, const at::Tensor& carry0, const at::Tensor& head_w, const at::Tensor& d2t,
    const at::Tensor& L, const at::Tensor& active, const at::Tensor& embed, const at::Tensor& in_norm,
    const at::Tensor& hidden_norm, const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& post_norm,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& final_norm, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& k_cache, const at::Tensor& v_cache, double eps, double scale,
    int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool norm_before_residual,
    bool norm_output, int64_t n, const at::Tensor& xi, double temperature, int64_t vocab) {
  const RawStep p{embed,     in_norm,   hidden_norm, qkv_w,   o_w,    post_norm, gate_up_w,
                  down_w,    final_norm, cos_table,  sin_table, k_cache, v_cache,  eps,
                  scale,     kv_len,    num_heads,   num_kv_heads, head_dim, norm_before_residual};
  const bool raw = chain_raw_ok("tritonspec_cpu::draft_chain_sampled", hn0, carry0, head_w, d2t, L, active, p, n);
  const int64_t B = hn0.size(0), Vd = head_w.size(0) * 16;
  TORCH_CHECK(xi.scalar_type() == at::kFloat && xi.dim() == 3 && xi.size(0) == B && xi.size(1) >= n &&
                  xi.size(2) == Vd && temperature > 0,
              "tritonspec_cpu::draft_chain_sampled: xi float32 [B, >= n, Vd] and a positive temperature");
  if (!raw) return {at::empty({0}, L.options()), at::empty({0}, hn0.options())};
  const int64_t* d2 = d2t.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < Vd; j++)
    TORCH_CHECK(j + d2[j] >= 0 && j + d2[j] < vocab, "tritonspec_cpu::draft_chain_sampled: draft id ", j,
                " maps to target id ", j + d2[j], ", outside the vocabulary [0, ", vocab, ")");
  at::Tensor lps = at::empty({B, n, Vd}, hn0.options());
  at::Tensor toks = draft_chain_raw(hn0, carry0, head_w, d2t, L, active, p, norm_output, n, xi, temperature, &lps);
  const at::Tensor e = lps.exp();  // [B, n, Vd]
  at::Tensor q = at::zeros({B, n, vocab}, hn0.options());
  const float* ep = e.const_data_ptr<float>();
  float* qp = q.mutable_data_ptr<float>();
  for (int64_t r = 0; r < B * n; r++)
    for (int64_t j = 0; j < Vd; j++) qp[r * vocab + j + d2[j]] += ep[r * Vd + j];
  return {toks, q};
}

// target_step's bfloat16 path: the Python forward's wrapper calls (linear, rms_norm, rope, kv_write, tree_attention,
// silu_mul, ATen's embedding, add and cat) made from C++ on the same tensors in the same order, so the same bits,
// without the ~16 Python-level dispatches a layer. Arguments already checked by target_step.
struct TargetArgs {  // target_step's arguments, for its bfloat16 path
  const at::Tensor &tokens, &embed;
  at::TensorList ln1, qkv, o, ln2, gate_up, down;
  const at::Tensor &final_norm, &cos_table, &sin_table, &positions, &slots, &k_cache, &v_cache, &prefix_lens,
      &tree_mask;
  double eps, scale;
  int64_t kv_len, num_heads, num_kv_heads, head_dim;
  at::IntArrayRef aux_ids;
  at::TensorList bqkv, bo, q_norm, k_norm;
};

std::tuple<at::Tensor, at::Tensor> target_step_aten(const TargetArgs& t) {
  const auto& [tokens, embed, ln1, qkv, o, ln2, gate_up, down, final_norm, cos_table, sin_table, positions, slots,
               k_cache, v_cache, prefix_lens, tree_mask, eps, scale, kv_len, num_heads, num_kv_heads, head_dim,
               aux_ids, bqkv, bo, q_norm, k_norm] = t;
  const int64_t B = tokens.size(0), Q = tokens.size(1), D = head_dim, NL = ln1.size();
  const int64_t hq = num_heads * D, hkv = num_kv_heads * D;
  const std::optional<at::Tensor> none;
  auto opt = [](at::TensorList ts, int64_t l) { return ts.empty() ? std::optional<at::Tensor>() : ts[l]; };
  at::Tensor h = at::embedding(embed, tokens);  // [B, Q, H]
  std::vector<at::Tensor> captured(NL + 1);
  captured[0] = h;
  // the rope tables gathered at the positions once per forward (RoPE.tables: cos[positions][:, :, None, :])
  const at::Tensor flat = positions.reshape({-1});
  const at::Tensor cos = cos_table.index_select(0, flat).view({B, Q, 1, D});
  const at::Tensor sin = sin_table.index_select(0, flat).view({B, Q, 1, D});
  for (int64_t l = 0; l < NL; l++) {
    at::Tensor x = std::get<0>(rms_norm(h, ln1[l], eps, none, -1));
    const auto parts = linear(x, qkv[l], opt(bqkv, l), -1).split_with_sizes({hq, hkv, hkv}, -1);
    at::Tensor q = parts[0].view({B, Q, num_heads, D});
    at::Tensor k = parts[1].view({B, Q, num_kv_heads, D});
    const at::Tensor v = parts[2].reshape({B, Q, num_kv_heads, D}).contiguous();
    if (!q_norm.empty()) {
      q = std::get<0>(rms_norm(q, q_norm[l], eps, none, -1));
      k = std::get<0>(rms_norm(k, k_norm[l], eps, none, -1));
    }
    q = rope(q, cos, sin);
    k = rope(k, cos, sin);
    const at::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    kv_write2(kc, vc, slots, k, v);
    at::Tensor a = tree_attention(q, kc, vc, prefix_lens, tree_mask, scale, kv_len, -1);
    a = linear(a.reshape({B, Q, hq}), o[l], opt(bo, l), -1);
    auto xr = rms_norm(a, ln2[l], eps, h, -1);
    h = std::get<1>(xr).add(linear(silu_mul(linear(std::get<0>(xr), gate_up[l], none, -1), -1), down[l], none, -1));
    captured[l + 1] = h;
  }
  std::vector<at::Tensor> parts;
  for (int64_t a : aux_ids) parts.push_back(captured[a]);
  at::Tensor aux = parts.empty() ? at::empty({0, Q, 0}, embed.options()) : at::cat(parts, -1);
  return {std::get<0>(rms_norm(h, final_norm, eps, none, -1)), aux};
}

// ---- the target's decode forward on raw buffers (runtime/target.py TargetModel.forward, kernels/cpu_target.py) ----
// Every layer of a decode step, verify or catch-up forward (not a prompt's) as one operator: the calls the Python
// forward makes through the torch backend's wrappers (linear, rms_norm, rope, kv_write, tree_attention, silu_mul),
// each kernel of linear.c, norm.c, rope_kv.c and attention.c called with the same arguments on the same values, on
// one work buffer, so the same bits (bfloat16 activations: target_step_aten). The residual add is one IEEE addition
// per element, as ATen's. Weights packed into panels (float32 or weight-only bfloat16; bfloat16 panels or AMX tiles
// under bfloat16), optional biases and per-head q/k norms (Qwen2, Qwen3); caches [L, B_max, S, Hkv, D] of the
// activations' dtype, layer i written at slots and read up to kv_len. aux_ids: the residual-stream
// boundaries (0 = the embedding, i = after layer i) concatenated into aux [B, Q, n_aux * H] (empty: none).
// Returns (hn, aux): the final norm of the last residual stream [B, Q, H], and aux.
std::tuple<at::Tensor, at::Tensor> target_step(
    const at::Tensor& tokens, const at::Tensor& embed, at::TensorList ln1, at::TensorList qkv, at::TensorList o,
    at::TensorList ln2, at::TensorList gate_up, at::TensorList down, const at::Tensor& final_norm,
    const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& positions, const at::Tensor& slots,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& prefix_lens, const at::Tensor& tree_mask,
    double eps, double scale, int64_t kv_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    at::IntArrayRef aux_ids, at::TensorList bqkv, at::TensorList bo, at::TensorList q_norm, at::TensorList k_norm) {
  const char* what = "tritonspec_cpu::target_step: ";
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  positions.sizes() == tokens.sizes() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slots.sizes() == tokens.sizes() && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              what, "tokens, positions and slots must be contiguous int64 [B, Q] tensors");
  const int64_t B = tokens.size(0), Q = tokens.size(1), R = B * Q, NL = ln1.size();
  TORCH_CHECK((embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16) && embed.dim() == 2 &&
                  embed.is_contiguous(),
              what, "the embedding must be a contiguous float32 or bfloat16 [V, H] tensor");
  const at::ScalarType dt = embed.scalar_type();  // the activations' dtype: every vector and the caches share it
  const bool bf = dt == at::kBFloat16;
  const int64_t V = embed.size(0), H = embed.size(1), D = head_dim, hq = num_heads * D, hkv = num_kv_heads * D;
  const int64_t W = hq + 2 * hkv;
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16 && D <= 256 &&
                  D % 2 == 0,
              what, "heads ", num_heads, " / ", num_kv_heads, " of ", D, " not supported");
  TORCH_CHECK(qkv.size() == NL && o.size() == NL && ln2.size() == NL && gate_up.size() == NL && down.size() == NL &&
                  NL >= 1,
              what, "one weight per layer in every list");
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.dim() == 5 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(0) == NL && k_cache.size(1) >= B &&
                  k_cache.size(3) == num_kv_heads && k_cache.size(4) == D && k_cache.stride(4) == 1 &&
                  k_cache.stride(3) == D && v_cache.stride(4) == 1 && v_cache.stride(3) == D,
              what, "the caches must be ", dt, " [", NL, ", >= ", B, ", S, ", num_kv_heads, ", ", D,
              "] with contiguous heads");
  TORCH_CHECK(prefix_lens.scalar_type() == at::kLong && prefix_lens.numel() == B && prefix_lens.is_contiguous(), what,
              "prefix_lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool && tree_mask.dim() == 3 && tree_mask.size(0) == B &&
                  tree_mask.size(1) == Q,
              what, "tree_mask must be a bool [B, Q, T] tensor");
  // float32 activations: panels of float32 or weight-only bfloat16; bfloat16 ones: bfloat16 panels or AMX tiles
  // (cpu_linear.pack_bf16, [N/16, K/32, 16, 32])
  auto panel = [&](const at::Tensor& w, int64_t n, int64_t k) {
    if (bf && w.dim() == 4)
      return w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) * 16 == n && w.size(1) * 32 == k &&
             w.size(2) == 16 && w.size(3) == 32;
    return w.dim() == 3 && w.size(2) == 16 && w.is_contiguous() && w.size(0) * 16 == n && w.size(1) == k &&
           (w.scalar_type() == at::kBFloat16 || (!bf && w.scalar_type() == at::kFloat));
  };
  const int64_t I = down[0].dim() == 3 ? down[0].size(1) : down[0].dim() == 4 ? down[0].size(1) * 32 : -1;
  for (int64_t i = 0; i < NL; i++) {
    TORCH_CHECK(panel(qkv[i], W, H) && panel(o[i], H, hq) && panel(gate_up[i], 2 * I, H) && panel(down[i], H, I), what,
                "layer ", i, ": projections must be packed (cpu_linear.pack_panels; bfloat16: or pack_bf16) for hidden ", H,
                ", ", num_heads, " + 2 x ", num_kv_heads, " heads of ", D, " and intermediate ", I);
    for (const at::Tensor* n : {&ln1[i], &ln2[i]})
      TORCH_CHECK(n->scalar_type() == dt && n->dim() == 1 && n->numel() == H && n->is_contiguous(), what,
                  "layer ", i, ": norm weights must be contiguous ", dt, " [", H, "]");
  }
  // optional per-layer weights (Qwen2's q/k/v biases, an output bias, Qwen3's per-head q/k norms): empty lists,
  // or one contiguous vector of the activations' dtype per layer
  auto vectors = [&](at::TensorList ts, int64_t n, const char* name) {
    TORCH_CHECK(ts.empty() || int64_t(ts.size()) == NL, what, name, ": none, or one per layer");
    for (const at::Tensor& t : ts)
      TORCH_CHECK(t.scalar_type() == dt && t.dim() == 1 && t.numel() == n && t.is_contiguous(), what, name,
                  " must be contiguous ", dt, " [", n, "] vectors");
  };
  vectors(bqkv, W, "bqkv");
  vectors(bo, H, "bo");
  vectors(q_norm, D, "q_norm");
  vectors(k_norm, D, "k_norm");
  TORCH_CHECK(q_norm.size() == k_norm.size(), what, "q_norm and k_norm come together");
  TORCH_CHECK(final_norm.scalar_type() == dt && final_norm.numel() == H && final_norm.is_contiguous(), what,
              "the final norm must be a contiguous ", dt, " [", H, "]");
  TORCH_CHECK(cos_table.scalar_type() == dt && cos_table.dim() == 2 && cos_table.size(1) == D &&
                  cos_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
                  sin_table.scalar_type() == dt && sin_table.is_contiguous(),
              what, "the rope tables must be contiguous ", dt, " [max_pos, ", D, "]");
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t npos = cos_table.size(0);
  for (int64_t i = 0; i < R; i++) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < V, what, "token id ", tok[i], " outside the embedding [0, ", V, ")");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < npos, what, "position ", pos[i], " outside the rope table [0, ", npos, ")");
  }
  std::vector<char> at_aux(NL + 1, 0);
  for (int64_t a : aux_ids) {
    TORCH_CHECK(a >= 0 && a <= NL, what, "aux layer id ", a, " outside [0, ", NL, "]");
    at_aux[a] = 1;
  }
  if (bf)
    return target_step_aten({tokens, embed, ln1, qkv, o, ln2, gate_up, down, final_norm, cos_table, sin_table,
                             positions, slots, k_cache, v_cache, prefix_lens, tree_mask, eps, scale, kv_len, num_heads,
                             num_kv_heads, head_dim, aux_ids, bqkv, bo, q_norm, k_norm});
  const int64_t n_aux = aux_ids.size();
  at::Tensor hn = at::empty({B, Q, H}, embed.options());
  at::Tensor aux = at::empty({n_aux ? B : 0, Q, n_aux * H}, embed.options());
  if (R == 0) return {hn, aux};
  const int64_t sizes[] = {H, H, H, W, hq, hkv, hq, H, 2 * I, I, H};
  int64_t total = 0;
  for (int64_t sz : sizes) total += R * sz;
  at::Tensor buf = at::empty({total}, embed.options());
  float* at_ = buf.mutable_data_ptr<float>();
  float *h, *x, *r, *qkvb, *qr, *kr, *att, *o2, *gu, *act, *dn;
  float** ptrs[] = {&h, &x, &r, &qkvb, &qr, &kr, &att, &o2, &gu, &act, &dn};
  for (int i = 0; i < 11; i++) {
    *ptrs[i] = at_;
    at_ += R * sizes[i];
  }
  const float fe = float(eps);
  const int nt = at::get_num_threads();
  const float* E = embed.const_data_ptr<float>();
  for (int64_t i = 0; i < R; i++) std::copy(E + tok[i] * H, E + (tok[i] + 1) * H, h + i * H);
  float* ax = n_aux ? aux.mutable_data_ptr<float>() : nullptr;
  auto capture = [&](int64_t boundary) {  // aux chunks in aux_ids' order
    for (int64_t c = 0; c < n_aux; c++)
      if (aux_ids[c] == boundary)
        for (int64_t i = 0; i < R; i++) std::copy(h + i * H, h + (i + 1) * H, ax + i * n_aux * H + c * H);
  };
  if (at_aux[0]) capture(0);
  const float* ct = cos_table.const_data_ptr<float>();
  const float* st = sin_table.const_data_ptr<float>();
  const int64_t S = k_cache.size(2), es = k_cache.element_size();
  const uint8_t* mask = cbytes(tree_mask);
  const int64_t* pl = prefix_lens.const_data_ptr<int64_t>();
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  for (int64_t l = 0; l < NL; l++) {
    tritonspec_rms_norm_f32(h, H, nullptr, 0, ln1[l].const_data_ptr<float>(), R, H, fe, x, nullptr, nt);
    lin_raw(x, R, H, qkv[l], qkvb, bqkv.empty() ? nullptr : bqkv[l].const_data_ptr<float>());
    if (!q_norm.empty()) {  // per-head RMSNorm of q and k (Qwen3), in place, before rope (the kernel's rows)
      const float *qw = q_norm[l].const_data_ptr<float>(), *kw = k_norm[l].const_data_ptr<float>();
      for (int64_t i = 0; i < R; i++) {
        float* row = qkvb + i * W;
        tritonspec_rms_norm_f32(row, D, nullptr, 0, qw, num_heads, D, fe, row, nullptr, 1);
        tritonspec_rms_norm_f32(row + hq, D, nullptr, 0, kw, num_kv_heads, D, fe, row + hq, nullptr, 1);
      }
    }
    const int64_t ko = l * k_cache.stride(0) * es, vo = l * v_cache.stride(0) * es;
    const RawCache cache{static_cast<char*>(k_cache.data_ptr()) + ko, static_cast<char*>(v_cache.data_ptr()) + vo,
                         k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), v_cache.stride(1), v_cache.stride(2),
                         v_cache.stride(3), S};
    raw_attention(qkvb, B, Q, num_heads, num_kv_heads, D, ct, st, pos, cache, sl, kv_len, pl, mask,
                  tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2), tree_mask.size(2), float(scale), nt,
                  qr, kr, att);
    lin_raw(att, R, hq, o[l], o2, bo.empty() ? nullptr : bo[l].const_data_ptr<float>());
    tritonspec_rms_norm_f32(o2, H, h, H, ln2[l].const_data_ptr<float>(), R, H, fe, x, r, nt);
    lin_raw(x, R, H, gate_up[l], gu);
    tritonspec_silu_mul_f32(gu, 2 * I, R, I, act, nt);
    lin_raw(act, R, I, down[l], dn);
    for (int64_t i = 0; i < R * H; i++) h[i] = r[i] + dn[i];
    if (at_aux[l + 1]) capture(l + 1);
  }
  tritonspec_rms_norm_f32(h, H, nullptr, 0, final_norm.const_data_ptr<float>(), R, H, fe, hn.mutable_data_ptr<float>(),
                          nullptr, nt);
  return {hn, aux};
}

}  // namespace

TORCH_LIBRARY(tritonspec_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int threads=-1) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens, Tensor tree_mask, float scale, "
        "int kv_len, int threads=-1) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual, int threads=-1) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("verify_greedy(Tensor tokens, Tensor parents, Tensor argmax, int max_depth) -> (Tensor, Tensor, Tensor)");
  m.def("build_tree(Tensor keep, Tensor cand_parent, Tensor cand_depth, int max_depth) -> (Tensor, Tensor, Tensor)");
  m.def("ngram_lookup(Tensor hist, Tensor L, int num_tokens, int n_max, int n_min) -> (Tensor, Tensor)");
  m.def("kv_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor start, Tensor nodes) -> ()");
  m.def("graft_chain(Tensor tokens, Tensor parents, Tensor depth, Tensor mask, Tensor chain, Tensor valid) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("row_random(Tensor key, Tensor(a!) counter, int n, int vocab) -> (Tensor, Tensor)");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("aux_gather(Tensor aux, Tensor index, Tensor? weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x, int threads=-1) -> Tensor");
  m.def("catch_up(Tensor aux, Tensor nodes, Tensor emitted, Tensor num, Tensor active, Tensor L, int N, int qc, "
        "Tensor fc, Tensor? fc_norm, Tensor? fc_in_norm, Tensor embed, Tensor in_norm, Tensor hidden_norm, Tensor qkv, "
        "Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, Tensor final_norm, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) hn_out, Tensor(d!) carry_out, float eps, float scale, "
        "int kv_len, int num_heads, int num_kv_heads, int head_dim, bool norm_before_residual, bool norm_output) "
        "-> bool");
  m.def("commit_history(Tensor(a!) hist, Tensor L, Tensor root, Tensor emitted, Tensor nodes, Tensor num, "
        "Tensor(b!) out, int n_tree) -> ()");
  m.def("draft_tree(Tensor hn0, Tensor carry0, Tensor head, Tensor d2t, Tensor L, Tensor active, Tensor root, "
        "Tensor embed, Tensor in_norm, Tensor hidden_norm, Tensor qkv, Tensor o, Tensor post_norm, Tensor gate_up, "
        "Tensor down, Tensor final_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, float eps, "
        "float scale, int kv_len, int num_heads, int num_kv_heads, int head_dim, bool norm_before_residual, "
        "bool norm_output, int K, int D, int N) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("verify_chain(Tensor tokens, Tensor probs, Tensor draft_probs, Tensor uniforms, Tensor exp_noise) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("drafter_step(Tensor hidden, Tensor tokens, Tensor embed, Tensor in_norm, Tensor hidden_norm, Tensor qkv, "
        "Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, Tensor final_norm, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor prefix_lens, Tensor tree_mask, "
        "float eps, float scale, int kv_len, int num_heads, int num_kv_heads, int head_dim, bool norm_before_residual) "
        "-> (Tensor, Tensor)");
  m.def("target_step(Tensor tokens, Tensor embed, Tensor[] ln1, Tensor[] qkv, Tensor[] o, Tensor[] ln2, "
        "Tensor[] gate_up, Tensor[] down, Tensor final_norm, Tensor cos, Tensor sin, Tensor positions, Tensor slots, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor prefix_lens, Tensor tree_mask, float eps, float scale, "
        "int kv_len, int num_heads, int num_kv_heads, int head_dim, int[] aux_ids, Tensor[] bqkv, Tensor[] bo, "
        "Tensor[] q_norm, Tensor[] k_norm) -> (Tensor, Tensor)");
  m.def("draft_chain(Tensor hn0, Tensor carry0, Tensor head, Tensor d2t, Tensor L, Tensor active, Tensor embed, "
        "Tensor in_norm, Tensor hidden_norm, Tensor qkv, Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, "
        "Tensor final_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, float eps, float scale, "
        "int kv_len, int num_heads, int num_kv_heads, int head_dim, bool norm_before_residual, bool norm_output, int n) "
        "-> Tensor");
  m.def("draft_chain_sampled(Tensor hn0, Tensor carry0, Tensor head, Tensor d2t, Tensor L, Tensor active, "
        "Tensor embed, Tensor in_norm, Tensor hidden_norm, Tensor qkv, Tensor o, Tensor post_norm, Tensor gate_up, "
        "Tensor down, Tensor final_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, float eps, "
        "float scale, int kv_len, int num_heads, int num_kv_heads, int head_dim, bool norm_before_residual, "
        "bool norm_output, int n, Tensor xi, float temperature, int vocab) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonspec_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("tree_attention", &tree_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("kv_write", &kv_write2);
  m.impl("verify_greedy", &verify_greedy);
  m.impl("build_tree", &build_tree);
  m.impl("ngram_lookup", &ngram_lookup);
  m.impl("graft_chain", &graft_chain);
  m.impl("kv_compact", &kv_compact);
  m.impl("drafter_step", &drafter_step);
  m.impl("draft_chain", &draft_chain);
  m.impl("row_random", &row_random);
  m.impl("argmax", &argmax);
  m.impl("aux_gather", &aux_gather);
  m.impl("silu_mul", &silu_mul);
  m.impl("catch_up", &catch_up);
  m.impl("draft_tree", &draft_tree);
  m.impl("commit_history", &commit_history);
  m.impl("verify_chain", &verify_chain);
  m.impl("target_step", &target_step);
  m.impl("draft_chain_sampled", &draft_chain_sampled);
}
