"""KV write: scatter the new tokens' K/V into one layer's cache at their slots.

    k_cache[b, slots[b, q]] = k[b, q]        v_cache[b, slots[b, q]] = v[b, q]

``slots[b, q] = -1`` (a padding query) writes to the trash slot ``S - 1`` instead, so the op
needs no host-side filtering and can run inside a CUDA graph. Values are cast to the cache dtype
(round to nearest even, as ``Tensor.to``). Tree attention reads the queries' own K/V from the
cache, so the runtime writes them first.
"""

from __future__ import annotations

import torch

from .utils import ENABLE_FP_FUSION, check_kv_cache, check_tensor, next_pow2, require_triton, round_to, tl, triton


def kv_write_reference(
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer), or [L, B_max, S, Hkv, D] with ``layer``
    v_cache: torch.Tensor,  # same shape as k_cache
    slots: torch.Tensor,  # [B, Q] int64 absolute slot per query; -1 = write nowhere
    k: torch.Tensor,  # [B, Q, Hkv, D]
    v: torch.Tensor,  # [B, Q, Hkv, D]
    layer: int | None = None,
) -> None:
    """Scatter the new tokens' K/V into the cache. Slot -1 goes to the trash slot ``S - 1``.

    ``layer``: the caches are every layer's, stacked, and the write goes to this layer through the
    stacked tensor itself, not a view of it: a compiled round (``torch.compile``) then updates the
    cache in place, where a write through ``cache[layer]`` made it copy the whole stack per write."""
    batch, nq = slots.shape
    trash = k_cache.shape[-3] - 1
    slot = torch.where(slots >= 0, slots, trash)
    rows = torch.arange(batch, device=slots.device)[:, None].expand(batch, nq)
    if layer is None:
        k_cache[rows, slot] = k.to(k_cache.dtype)
        v_cache[rows, slot] = v.to(v_cache.dtype)
    else:  # a tensor index for the layer: cache[layer, ...] would write through a view of the layer
        layers = torch.full_like(rows, layer)
        k_cache.index_put_((layers, rows, slot), k.to(k_cache.dtype))
        v_cache.index_put_((layers, rows, slot), v.to(v_cache.dtype))


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# One program per (query token, column chunk of Hkv*D); slot -1 goes to the trash slot S-1,
# exactly like the reference.
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["Q", "S"])
def _kv_write_kernel(
    k_cache_ptr,  # [B_max, S, Hkv, D]: rows at stride_kb, slots at stride_ks, (Hkv, D) contiguous
    v_cache_ptr,  # [B_max, S, Hkv, D]
    slots_ptr,  # [B, Q] int64, PAD = write to the trash slot S-1
    k_ptr,  # [B, Q, Hkv, D]: rows at stride_nb, tokens at stride_nq, (Hkv, D) contiguous
    v_ptr,  # [B, Q, Hkv, D]: same strides as k
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_nb,
    stride_nq,
    Q,
    S,
    HD: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    bq = tl.program_id(0).to(tl.int64)
    b = bq // Q
    slot = tl.load(slots_ptr + bq)
    slot = tl.where(slot == PAD, S - 1, slot)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HD
    src = b * stride_nb + (bq - b * Q) * stride_nq + cols
    k = tl.load(k_ptr + src, mask=mask, other=0.0)
    v = tl.load(v_ptr + src, mask=mask, other=0.0)
    k_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
    v_dtype: tl.constexpr = v_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + b * stride_kb + slot * stride_ks + cols, round_to(k.to(tl.float32), k_dtype), mask=mask)
    tl.store(v_cache_ptr + b * stride_vb + slot * stride_vs + cols, round_to(v.to(tl.float32), v_dtype), mask=mask)


def kv_write(
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer), or [L, B_max, S, Hkv, D] with ``layer``
    v_cache: torch.Tensor,  # same shape as k_cache
    slots: torch.Tensor,  # [B, Q] int64, -1 = trash slot S-1
    k: torch.Tensor,  # [B, Q, Hkv, D]
    v: torch.Tensor,  # [B, Q, Hkv, D]
    layer: int | None = None,
) -> None:
    """Triton twin of ``kv_write_reference`` (in place). Slots are not range-checked (no host sync)."""
    require_triton()
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    check_kv_cache("k_cache", k_cache)
    check_kv_cache("v_cache", v_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    b_max, S, hkv, d = k_cache.shape
    check_tensor("slots", slots, dtypes=(torch.int64,), ndim=2, device=k_cache.device)
    B, Q = slots.shape
    if B > b_max:
        raise ValueError(f"slots has {B} rows but the cache holds only {b_max}")
    check_kv_cache("k", k)
    check_kv_cache("v", v)
    check_tensor("k", k, shape=(B, Q, hkv, d), contiguous=False, device=k_cache.device)
    check_tensor("v", v, shape=(B, Q, hkv, d), contiguous=False, device=k_cache.device)
    if k.stride()[:2] != v.stride()[:2]:
        raise ValueError(f"k and v must share strides, got {k.stride()} and {v.stride()}")
    if B * Q == 0:
        return
    hd = hkv * d
    block = min(next_pow2(hd), 1024)
    _kv_write_kernel[(B * Q, triton.cdiv(hd, block))](
        k_cache, v_cache, slots, k, v,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k.stride(0), k.stride(1),
        Q, S, HD=hd, BLOCK=block, PAD=-1,
        num_warps=4, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
