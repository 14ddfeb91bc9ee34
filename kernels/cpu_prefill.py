"""Causal prefill attention for the CPU (issue 17): a prompt over its own K/V, the masked half skipped.

Math, for ``q [B, P, Hq, D]`` and ``k, v [B, P, Hkv, D]`` (an empty prefix, G = Hq / Hkv):

    out[b, i, h] = sum_{j <= i} softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G]

computed in float32 by ``kernels/cpu/prefill.c`` (tiles of 8 query rows x 32-key blocks up to the tile's
last row, outer products, an online softmax). Why: PyTorch's CPU flash attention pays for the whole square
below 512 tokens (its key blocks are 512 long), and prefill attention was 37 % of the demo target's prefill
on one Zen 4 core (``perf/CPU_DECODE.md``).

On CPUs with AMX (Sapphire Rapids and later), prompts of at least ``AMX_MIN_TOKENS`` tokens with a head dim
that is a multiple of 32 run both products on the tile unit instead (``set_amx``): each float32 operand split
exactly into three bfloat16 parts, six of the nine part products kept (the dropped three are below 2^-21 of
the product), accumulated in float32, so the error stays float32-class (measured closer to a float64
reference than the AVX-512 tile). 1.15-1.25x faster than the AVX-512 tile on the demo's heads from ~256
tokens, 1.1-1.15x on SmolLM2's from ~300; long demo prompts prefill ~16 % faster than at the start of the
session that added both tiles' lazy-maximum softmax (``perf/CPU_DECODE.md``).

Not row-invariant, either path (neither is SDPA): prompts only. Shares the build, cache and ``cpu_linear``
switch of ``kernels.cpu_linear``.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import cpu_linear as _lib
from .tree_attention import tree_attention_reference

MAX_HEAD_DIM = 256  # prefill.c's PF_MAX_D
AMX_MIN_TOKENS = 128  # prefill.c's AMX_MIN_P: shorter prompts run the AVX-512 tile


def set_amx(on: bool) -> bool:
    """Run prompts of at least ``AMX_MIN_TOKENS`` tokens (head dim a multiple of 32) on the AMX tile unit
    (``kernels/cpu/prefill.c`` ``tile_amx``: both products from exact three-part bfloat16 splits, float32-class
    error) or on the AVX-512 tile; returns the previous setting. On by default where AMX runs
    (``cpu_linear.amx_available()``; ``TRITONSPEC_CPU_PREFILL_AMX=0`` starts a process with it off); elsewhere
    it stays off (returns False). The two paths round differently (prompts only, neither row-invariant), so this
    is here for side-by-side measurements and tests.

    Example
    -------
    >>> old = set_amx(False)  # doctest: +SKIP
    >>> _ = set_amx(old)  # doctest: +SKIP
    """
    return bool(_lib._set_rows_knob("tritonspec_prefill_amx", int(on), "the AMX prefill path"))


def amx_calls() -> int:
    """How many calls ran the AMX path (``set_amx``) so far in this process: for tests that must see it taken."""
    return _lib._count("tritonspec_prefill_amx_calls")


def cpu_prefill_attention_reference(
    q: torch.Tensor,  # [B, P, Hq, D]
    k: torch.Tensor,  # [B, P, Hkv, D]
    v: torch.Tensor,  # [B, P, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [B, P, Hq, D], dtype of q
    """``tree_attention_reference`` in float64 over an empty prefix with a causal tree mask (the prompt's
    own K/V as the cache), rounded once to ``q``'s dtype."""
    B, P = q.shape[:2]
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    zero = torch.zeros(B, dtype=torch.int64)
    return tree_attention_reference(q.double(), k.double(), v.double(), zero, causal, scale).to(q.dtype)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: float32 CPU ``q [B, P, Hq, D]``, ``k``/``v [B, P, Hkv, D]``,
    D a multiple of 16 up to ``MAX_HEAD_DIM``, Hq a multiple of Hkv, unit stride along D, no autograd."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 for t in (q, k, v)):
        return False
    B, P, Hq, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, P) or k.shape[3] != D or k.shape[2] == 0:
        return False
    if D % 16 or D > MAX_HEAD_DIM or Hq % k.shape[2]:
        return False
    if any(t.stride(3) != 1 for t in (q, k, v)):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))


def cpu_prefill_attention(
    q: torch.Tensor,  # [B, P, Hq, D] float32, unit stride along D
    k: torch.Tensor,  # [B, P, Hkv, D] float32, unit stride along D
    v: torch.Tensor,  # [B, P, Hkv, D] float32, unit stride along D
    scale: float,
    threads: int | None = None,
) -> torch.Tensor:  # [B, P, Hq, D] contiguous
    """Causal attention of a prompt over its own K/V with the CPU kernel (module docstring);
    ``threads`` defaults to ``torch.get_num_threads()``.

    Example
    -------
    >>> q, k = torch.randn(1, 9, 4, 32), torch.randn(1, 9, 2, 32)
    >>> cpu_prefill_attention(q, k, k, 32**-0.5).shape  # doctest: +SKIP
    torch.Size([1, 9, 4, 32])
    """
    if not supported(q, k, v):
        raise ValueError(
            "cpu_prefill_attention takes float32 CPU q [B, P, Hq, D] and k, v [B, P, Hkv, D] (D a multiple of 16, "
            f"at most {MAX_HEAD_DIM}; Hq a multiple of Hkv; unit stride along D; no autograd); got q "
            f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}"
        )
    return cpu_prefill_attention_unchecked(q, k, v, scale, threads)


def cpu_prefill_attention_unchecked(q, k, v, scale, threads=None) -> torch.Tensor:  # checked: ``supported``
    B, P, Hq, D = q.shape
    out = torch.empty((B, P, Hq, D), dtype=q.dtype)
    if out.numel() == 0:
        return out
    rc = _lib._library().tritonspec_prefill_attention_f32(
        q.data_ptr(), B, P, Hq, k.shape[2], D, *q.stride()[:3],
        k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
        out.data_ptr(), float(scale), threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"cpu_prefill_attention: out of memory for the transposed K ({B} x {k.shape[2]} x {D} x {P})")
    return out


def runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``TorchOps.prefill_attention`` takes the kernel for these tensors: ``supported``, an
    eager call (not traced), on an AVX-512 CPU (measured faster than SDPA there, ``perf/CPU_DECODE.md``;
    AVX2 CPUs keep SDPA until measured). The caller has checked the ``cpu_linear`` switch."""
    if _lib.isa() != "avx512" or not supported(q, k, v):
        return False
    return not (torch.compiler.is_compiling() or get_proxy_mode() is not None or isinstance(q, FakeTensor))
