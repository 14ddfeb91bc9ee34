"""Rotary embedding and KV-cache writes for the eager CPU decode path (issue 21).

Math (``runtime/rope.py``, ``kernels/kv_write.py``):

    rope:      y = x * cos + rotate_half(x) * sin        rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    kv_write:  cache[b, slots[b, i]] = k[b, i], v likewise    slot -1 -> the trash slot S - 1

``kernels/cpu/rope_kv.c`` rounds exactly as PyTorch's eager ops do (each product to the storage
dtype, then the sum; no fused multiply-add), so the results are bit-identical to the references:
only the cost changes. An eager SmolLM2 step spent ~20 small PyTorch ops a layer here (slices,
negation, concatenation, index tensors, two ``index_put_``); one call each replaces them. While a
graph is traced (``torch.compile``) the references run, so inductor fuses them as before.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import cpu_linear as _lib
from .kv_write import kv_write_reference

_DTYPES = (torch.float32, torch.bfloat16)


def rope_reference(
    x: torch.Tensor,  # [B, Q, H, D]
    cos: torch.Tensor,  # [B, Q, 1, D]
    sin: torch.Tensor,  # [B, Q, 1, D]
) -> torch.Tensor:  # [B, Q, H, D]
    """``x * cos + rotate_half(x) * sin`` (``runtime.rope.Rope.apply``)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _tracing(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or get_proxy_mode() is not None or isinstance(x, FakeTensor)


def rope(
    x: torch.Tensor,  # [B, Q, H, D], unit stride along D
    cos: torch.Tensor,  # [B, Q, 1, D], dtype of x
    sin: torch.Tensor,  # [B, Q, 1, D]
) -> torch.Tensor:  # [B, Q, H, D]
    """``rope_reference``, bit for bit: the C kernel on an eager CPU call of float32/bfloat16 tensors
    (the caller checked ``kernels.cpu_linear.enabled``) where the native operator built, else the
    reference (there is no ctypes path: the saving is the per-call overhead ctypes would add back).

    Example
    -------
    >>> x, c, s = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    >>> torch.equal(rope(x, c, s), rope_reference(x, c, s))  # doctest: +SKIP
    True
    """
    ok = (
        x.dtype in _DTYPES
        and cos.dtype == x.dtype
        and sin.dtype == x.dtype
        and x.dim() == 4
        and x.stride(3) == 1
        and x.shape[3] % 2 == 0
        and cos.shape == (x.shape[0], x.shape[1], 1, x.shape[3])
        and sin.shape == cos.shape
        and cos.stride() == sin.stride()
        and cos.stride(3) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
    )
    if not ok or _tracing(x) or not _lib._native_ready():
        return rope_reference(x, cos, sin)
    return torch.ops.tritonspec_cpu.rope(x, cos, sin)


def kv_write(
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer), or [L, B_max, S, Hkv, D] with layer
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B, Q] int64, -1 = the trash slot S - 1
    k: torch.Tensor,  # [B, Q, Hkv, D]
    v: torch.Tensor,  # [B, Q, Hkv, D]
    layer: int | None = None,
) -> None:
    """``kv_write_reference``, bit for bit: a row copy per token on an eager CPU call where the
    dtypes match and (heads, head dim) are contiguous, else the reference (and always while traced:
    a compiled round updates the stacked cache through the reference's ``index_put_``)."""
    kc = k_cache if layer is None else k_cache[layer]
    vc = v_cache if layer is None else v_cache[layer]
    d = k.shape[-1]
    ok = (
        k.dtype in _DTYPES
        and all(t.dtype == k.dtype for t in (v, kc, vc))
        and kc.dim() == 4
        and kc.shape == vc.shape
        and k.shape == v.shape
        and kc.shape[2:] == k.shape[2:]
        and all(t.stride(3) == 1 and t.stride(2) == d for t in (k, v, kc, vc))
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.shape == k.shape[:2]
    )
    if not ok or _tracing(k) or not _lib._native_ready():
        return kv_write_reference(k_cache, v_cache, slots, k, v, layer)
    torch.ops.tritonspec_cpu.kv_write(kc, vc, slots, k, v)
