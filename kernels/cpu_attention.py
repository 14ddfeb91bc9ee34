"""Row-invariant decode and tree attention for the CPU (issues 21 and 16).

Math, for queries ``q [B, Q, Hq, D]`` over one layer's cache ``[B_max, S, Hkv, D]``:

    out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G]       G = Hq / Hkv

over the slots ``j`` query ``i`` sees, in ascending order: the committed prefix ``j < prefix_lens[b]``,
then the tree slots ``prefix_lens[b] + t`` with ``tree_mask[b, i, t]`` (``kernels.tree_attention``'s
contract; no visible slot gives zeros). Computed in float32, rounded once to ``q``'s dtype.

Why a kernel of our own: a one-query SDPA over the padded key bound cost ~90 us a layer for SmolLM2
(a fifth of a compiled bfloat16 decode step), and PyTorch's attention rounds a row differently by
how many queries share the call. ``kernels/cpu/attention.c`` walks each query's visible keys in
blocks of 64 *visible* keys with an online softmax in one fixed order, so a token's attention output
is bit-identical when it is verified as a tree node and when it is decoded alone after its
ancestors were committed: speculative and plain decoding agree in bfloat16 as in float32, and the
batch does not matter. It shares the build, cache and selection of ``kernels.cpu_linear`` (one
library, one ``cpu_linear`` switch for the CPU kernels).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import cpu_linear as _lib
from .tree_attention import tree_attention_reference

MAX_GROUP = 16  # query heads per KV head (attention.c's MAX_G)
MAX_HEAD_DIM = 256  # attention.c's MAX_D
_DTYPES = (torch.float32, torch.bfloat16)


def set_transposed_scores(on: bool) -> bool:
    """Turn the shared-prefix path's transposed scores on or off (``kernels/cpu/attention.c`` ``scores_t``: a
    verify's queries over a full prefix block score it from the block transposed once, 16 keys in the lanes,
    instead of a lane-sum tree per key); returns the previous setting. Both ways compute the same bits, so this
    only changes speed: it is here for side-by-side measurements (``TRITONSPEC_CPU_ATTENTION_KT=0`` starts a
    process with it off). AVX2 CPUs run the shared blocks query by query and never use it.

    Example
    -------
    >>> old = set_transposed_scores(False)  # doctest: +SKIP
    >>> _ = set_transposed_scores(old)  # doctest: +SKIP
    """
    return bool(_lib._set_rows_knob("tritonspec_attention_kt", int(on), "the transposed scores"))


def transposed_blocks() -> int:
    """How many prefix blocks the transposed scores ran on so far in this process (``set_transposed_scores``),
    through ctypes and the native operator together: for tests that must see the path taken."""
    return _lib._count("tritonspec_attention_kt_blocks")


def cpu_tree_attention_reference(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D], dtype of q
    """``tree_attention_reference`` in float32, rounded once to ``q``'s dtype."""
    out = tree_attention_reference(q.float(), k_cache.float(), v_cache.float(), prefix_lens, tree_mask, scale, kv_len)
    return out.to(q.dtype)


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens, tree_mask) -> bool:
    """Whether the kernel takes these tensors (dtypes, head shapes, strides); else the caller runs SDPA."""
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tree_mask.dim() != 3:
        return False
    hq, d, hkv = q.shape[2], q.shape[3], k_cache.shape[2]
    if k_cache.shape[3] != d or hkv == 0 or hq % hkv or hq // hkv > MAX_GROUP or d > MAX_HEAD_DIM:
        return False
    if q.stride(3) != 1 or any(c.stride(3) != 1 or c.stride(2) != d for c in (k_cache, v_cache)):
        return False
    return (
        prefix_lens.dtype == torch.int64
        and prefix_lens.is_contiguous()
        and tree_mask.dtype == torch.bool
        and k_cache.shape[0] >= q.shape[0]
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def cpu_tree_attention(
    q: torch.Tensor,  # [B, Q, Hq, D] float32 or bfloat16, unit stride along D
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D], dtype of q, unit stride along D, heads D apart
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64, contiguous
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,  # slots >= kv_len are never read
    threads: int | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D] contiguous
    """Tree attention with the row-invariant CPU kernel (see the module docstring); ``threads``
    defaults to ``torch.get_num_threads()`` (one for small calls); the result does not depend on it.

    Example
    -------
    >>> q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 9, 2, 16)
    >>> mask = torch.ones(1, 2, 2, dtype=torch.bool)
    >>> out = cpu_tree_attention(q, k, k, torch.tensor([7]), mask, 0.25)  # doctest: +SKIP
    >>> out.shape  # doctest: +SKIP
    torch.Size([1, 2, 4, 16])
    """
    if not all(t.device.type == "cpu" for t in (q, k_cache, v_cache, prefix_lens, tree_mask)):
        raise ValueError("cpu_tree_attention runs on CPU tensors")
    if not supported(q, k_cache, v_cache, prefix_lens, tree_mask):
        raise ValueError(
            f"cpu_tree_attention takes float32/bfloat16 q [B, Q, Hq, D] and caches [B_max>=B, S, Hkv, D] of one "
            f"dtype (Hq a multiple of Hkv, at most {MAX_GROUP}x; D <= {MAX_HEAD_DIM}; unit stride along D), int64 "
            f"prefix_lens and a bool tree_mask [B, Q, T]; got q {tuple(q.shape)} {q.dtype}, k_cache "
            f"{tuple(k_cache.shape)} {k_cache.dtype}, prefix_lens {prefix_lens.dtype}, tree_mask "
            f"{tuple(tree_mask.shape)} {tree_mask.dtype}"
        )
    if tree_mask.shape[:2] != q.shape[:2] or prefix_lens.shape != (q.shape[0],):
        raise ValueError(f"tree_mask must be [B, Q, T] and prefix_lens [B] for q {tuple(q.shape)}")
    return _launch(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, threads)


def _launch(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, threads) -> torch.Tensor:
    kv = -1 if kv_len is None else int(kv_len)
    if _lib._native_ready():
        return torch.ops.tritonspec_cpu.tree_attention(
            q, k_cache, v_cache, prefix_lens, tree_mask, float(scale), kv, -1 if threads is None else threads
        )
    return _launch_ctypes(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv, threads)


def _launch_ctypes(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, threads) -> torch.Tensor:
    B, Q, Hq, D = q.shape
    out = torch.empty((B, Q, Hq, D), dtype=q.dtype)
    if out.numel() == 0:
        return out
    S = k_cache.shape[1] if kv_len < 0 else min(kv_len, k_cache.shape[1])
    lib = _lib._library()
    fn = lib.tritonspec_tree_attention_f32 if q.dtype == torch.float32 else lib.tritonspec_tree_attention_bf16
    rc = fn(
        q.data_ptr(), B, Q, Hq, D, q.stride(0), q.stride(1), q.stride(2),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        prefix_lens.data_ptr(), tree_mask.data_ptr(), *tree_mask.stride(), tree_mask.shape[-1], S, float(scale),
        out.data_ptr(), threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise MemoryError("cpu_tree_attention: out of memory for the shared-prefix scratch")
    if rc != 0:
        raise ValueError(
            f"cpu_tree_attention: head shape q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} not supported"
        )
    return out


@torch.library.custom_op("tritonspec::cpu_tree_attention", mutates_args=())
def _cpu_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    kv_len: int,
) -> torch.Tensor:
    return _launch_ctypes(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, None)


@_cpu_attention_op.register_fake
def _(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len):
    return _lib._fake_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len)


def tree_attention(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
    threads: int | None = None,
) -> torch.Tensor | None:  # [B, Q, Hq, D], or None: the kernel does not take these tensors
    """The CPU kernel for the torch backend (the caller checked ``kernels.cpu_linear.enabled``), or
    None when it does not apply (the caller then runs SDPA). While a graph is traced the kernel is an
    opaque operator (``tritonspec_cpu::tree_attention``, else the Python custom op
    ``tritonspec::cpu_tree_attention``), so compiled and eager rounds compute the same bits.
    ``threads``: as ``cpu_tree_attention`` (deterministic mode passes the caller's count)."""
    if not supported(q, k_cache, v_cache, prefix_lens, tree_mask):
        return None
    kv = -1 if kv_len is None else int(kv_len)
    tracing = torch.compiler.is_compiling() or get_proxy_mode() is not None or isinstance(q, FakeTensor)
    if tracing and not _lib._native_ready():
        return _cpu_attention_op(q, k_cache, v_cache, prefix_lens, tree_mask, float(scale), kv)
    return _launch(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv, threads)
