"""Row-invariant RMSNorm for the CPU (issues 21 and 16).

Math, for ``x [..., H]`` (and an optional ``residual`` of the same shape), weights ``w [H]``:

    s = x + residual                                  rounded to x's dtype (as PyTorch's add)
    y = w * round(s * rsqrt(mean(s^2) + eps))          sum of squares in float32, y rounded once

``rms_norm_reference``'s contract, with the sum of squares in one fixed order per row
(``kernels/cpu/norm.c``). Why a kernel: in eager rounds the reference is ~8 PyTorch ops a call
(~2 ms of a SmolLM2 step), and in compiled rounds inductor generates a separate reduction for each
row count, so a row could round differently in a one-row step and a verify forward (seen in
bfloat16). As an opaque operator it computes every row the same way, eager or compiled. It shares
the build, cache and ``cpu_linear`` switch of ``kernels.cpu_linear``.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import cpu_linear as _lib
from .rms_norm import rms_norm_reference

_DTYPES = (torch.float32, torch.bfloat16)


cpu_rms_norm_reference = rms_norm_reference  # what the kernel computes, up to the order of the sum of squares


def supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors; else the caller runs the reference."""
    return (
        x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual)))
    )


def cpu_rms_norm(
    x: torch.Tensor,  # [..., H] float32 or bfloat16
    weight: torch.Tensor,  # [H], dtype of x
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H], dtype of x
    threads: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # y [..., H], or (y, x + residual)
    """RMSNorm with the row-invariant CPU kernel (see the module docstring); ``threads`` defaults to
    ``torch.get_num_threads()`` (one below 64 rows); the result does not depend on it.

    Example
    -------
    >>> x = torch.randn(3, 99)
    >>> want = x * x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    >>> torch.allclose(cpu_rms_norm(x, torch.ones(99), 1e-6), want, atol=1e-5)  # doctest: +SKIP
    True
    """
    if not all(t.device.type == "cpu" for t in (x, weight) + (() if residual is None else (residual,))):
        raise ValueError("cpu_rms_norm runs on CPU tensors")
    if not supported(x, weight, residual):
        raise ValueError(
            f"cpu_rms_norm takes float32/bfloat16 x [..., H], weight [H] and residual of x's shape, one dtype; got x "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, residual "
            f"{None if residual is None else (tuple(residual.shape), residual.dtype)}"
        )
    return _launch(x, weight, eps, residual, threads)


def _launch(x, weight, eps, residual, threads):
    if _lib._native_ready():
        y, s = torch.ops.tritonspec_cpu.rms_norm(x, weight, float(eps), residual, -1 if threads is None else threads)
    else:
        y, s = _launch_ctypes(x, weight, eps, residual, threads)
    return y if residual is None else (y, s)


def _launch_ctypes(x, weight, eps, residual, threads) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype)
    s = torch.empty(x.shape, dtype=x.dtype) if residual is not None else x.new_empty((0,))
    M = x.numel() // H if H else 0
    if M == 0:
        return y, s
    x2 = x.reshape(M, H)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(M, H)
        if r2.stride(1) != 1:
            r2 = r2.contiguous()
    lib = _lib._library()
    fn = lib.tritonspec_rms_norm_f32 if x.dtype == torch.float32 else lib.tritonspec_rms_norm_bf16
    fn(
        x2.data_ptr(), x2.stride(0), None if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
        weight.data_ptr(), M, H, float(eps), y.data_ptr(), None if residual is None else s.data_ptr(),
        threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    return y, s


@torch.library.custom_op("tritonspec::cpu_rms_norm", mutates_args=())
def _cpu_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_ctypes(x, weight, eps, residual, None)


@_cpu_norm_op.register_fake
def _(x, weight, eps, residual):
    return _lib._fake_norm(x, weight, eps, residual)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:  # None: the kernel does not take these tensors
    """The CPU kernel for the torch backend (the caller checked ``kernels.cpu_linear.enabled``), or
    None when it does not apply. While a graph is traced it is an opaque operator
    (``tritonspec_cpu::rms_norm``, else the Python custom op ``tritonspec::cpu_rms_norm``)."""
    if not supported(x, weight, residual):
        return None
    tracing = torch.compiler.is_compiling() or get_proxy_mode() is not None or isinstance(x, FakeTensor)
    if tracing and not _lib._native_ready():
        y, s = _cpu_norm_op(x, weight, float(eps), residual)
        return y if residual is None else (y, s)
    return _launch(x, weight, eps, residual, None)


def aux_gather(
    aux: torch.Tensor,  # [n_src, n_aux*H]
    index: torch.Tensor,  # [n] int64, negative = padding row
    fc_norm_weight: torch.Tensor | None,  # [n_aux, H], or None: plain gather
    eps: float,
) -> torch.Tensor | None:  # [n, n_aux*H], or None: the caller runs the reference
    """``kernels.aux_gather.aux_gather_reference`` as one native operator (``tritonspec_cpu::aux_gather``): each
    gathered H-wide chunk through this module's kernel (the bits of ``cpu_rms_norm`` on that chunk), padding
    rows zero. EAGLE-3.1's decode-round gather was ~8 PyTorch ops (~140 us a round of the demo pair, one thread).
    None where the native operator is not built or the tensors are not ones it takes (the reference then runs);
    an opaque operator while a graph is traced.

    Example
    -------
    >>> aux, w = torch.randn(5, 3 * 64), torch.rand(3, 64)
    >>> out = aux_gather(aux, torch.tensor([4, -1, 0]), w, 1e-6)  # doctest: +SKIP
    >>> bool(out[1].eq(0).all())  # doctest: +SKIP
    True
    """
    if not _lib._native_ready() or aux.dim() != 2 or aux.dtype not in _DTYPES or aux.stride(1) != 1:
        return None
    if index.dtype != torch.int64 or index.dim() != 1 or index.device.type != "cpu" or aux.device.type != "cpu":
        return None
    if fc_norm_weight is not None:
        w = fc_norm_weight
        if w.dtype != aux.dtype or w.dim() != 2 or not w.is_contiguous() or w.numel() != aux.shape[1]:
            return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (aux, fc_norm_weight)):
        return None
    return torch.ops.tritonspec_cpu.aux_gather(aux, index, fc_norm_weight, float(eps))


def silu_mul_reference(
    gate_up: torch.Tensor,  # [..., 2 * I]: the gate projection's I columns, then the up projection's
) -> torch.Tensor:  # [..., I]
    """SwiGLU's gate product ``silu(g) * u`` with ``g, u = gate_up.chunk(2, -1)`` and ``silu(g) = g / (1 + exp(-g))``
    (PyTorch's ``F.silu`` and ``*``, each rounded to the input's dtype)."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def silu_mul(
    gate_up: torch.Tensor,  # [..., 2 * I] float32 or bfloat16, unit stride along the last dim
) -> torch.Tensor | None:  # [..., I] contiguous, or None: the caller runs the reference
    """``silu_mul_reference`` as one native operator (``tritonspec_cpu::silu_mul``, ``kernels/cpu/norm.c``): one
    pass over the rows, every element by the same instruction sequence (exp by ``exp.h``'s polynomial, ~1 ulp from
    PyTorch's), so a row's values do not depend on its call. The two PyTorch ops cost ~4 us a call at one decode
    row and ~130 us at 440 prompt rows (the demo's MLP, one thread). None where the native operator is not built
    or the tensor is not one it takes; an opaque operator while a graph is traced.

    Example
    -------
    >>> gu = torch.randn(3, 2 * 99)
    >>> torch.allclose(silu_mul(gu), silu_mul_reference(gu), rtol=1e-5, atol=1e-6)  # doctest: +SKIP
    True
    """
    if not _lib._native_ready() or gate_up.device.type != "cpu" or gate_up.dtype not in _DTYPES:
        return None
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 or gate_up.stride(-1) != 1:
        return None
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return None
    return torch.ops.tritonspec_cpu.silu_mul(gate_up, -1)
