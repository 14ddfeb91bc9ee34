"""KV-cache compaction along the accepted path of a draft tree.

After verification the target cache holds the root and all N tree nodes at slots
``start[b] + node``. The accepted path ``nodes[b, 0..a]`` (``nodes[b, 0] == 0``, the root) is
moved into contiguous slots, for every layer:

    cache[l, b, start[b] + k] <- cache[l, b, start[b] + nodes[b, k]]     for k with nodes[b, k] >= 0

Source and destination ranges overlap. The path's node ids increase along the path and
``nodes[b, k] >= k``, so every source is read before any destination that could alias it is
written (the reference reads all sources first).
"""

from __future__ import annotations

import torch

from .store import tuned
from .utils import FLOAT_DTYPES, check_tensor, next_pow2, require_triton, tl, triton


def kv_compact_reference(
    k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    start: torch.Tensor,  # [B] int64, slot of the tree root per row
    nodes: torch.Tensor,  # [B, M] int64, accepted node ids (root first), -1 = none
) -> None:
    """Move accepted K/V into slots ``start .. start+a`` in place (rows ``0..B-1`` of the cache)."""
    batch, width = nodes.shape
    valid = nodes >= 0  # [B, M]
    ar = torch.arange(width, device=nodes.device)
    src = start[:, None] + nodes.clamp(min=0)  # [B, M]
    dst = torch.where(valid, start[:, None] + ar, src)  # invalid entries copy a slot onto itself
    rows = torch.arange(batch, device=nodes.device)[:, None].expand(batch, width)
    for cache in (k_cache, v_cache):
        moved = cache[:, rows, src]  # [L, B, M, Hkv, D], read everything first
        cache[:, rows, dst] = moved


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# Grid (column chunks of Hkv*D, B, L): each program moves one column chunk of the whole
# accepted path of one row in one layer, K and V. Overlap: a source slot start+nodes[j] can be
# the destination start+k of another path entry (k = nodes[j] > j), and different threads of
# the program hold different path entries, so all loads are done and a CTA barrier passed
# before any store (the reference's "read everything first"; SGLang's copy_all_layer_kv_cache
# does the same). Programs never share a (layer, row, column), so no inter-CTA hazard exists.
# Entries with nodes[j] == j (already in place) and padding (-1) are skipped: the reference
# copies those slots onto themselves.
# --------------------------------------------------------------------------------------------
def compact_config(
    hd: int, block_m: int, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> tuple[int, int]:
    """``(BLOCK_C, num_warps)`` per row width Hkv*D (a discrete copy: every config gives the same bits)."""
    default = {"BLOCK_C": min(next_pow2(hd), max(8192 // block_m, 128)), "num_warps": 4}
    cfg = tuned("kv_compact", hd, default, dtype=dtype, device=device)
    return cfg["BLOCK_C"], cfg["num_warps"]


@triton.jit
def _kv_compact_kernel(
    k_ptr,  # [L, B_max, S, HD] contiguous
    v_ptr,  # [L, B_max, S, HD] contiguous
    start_ptr,  # [B] int64
    nodes_ptr,  # [B, M] int64, NONE = no entry
    stride_l,  # B_max * S * HD
    stride_b,  # S * HD
    HD: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NONE: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    node = tl.load(nodes_ptr + b * M + j, mask=j < M, other=NONE)
    move = (node != NONE) & (node >= 0) & (node != j)
    st = tl.load(start_ptr + b)
    src = (st + tl.maximum(node, 0)) * HD  # [BLOCK_M]
    dst = (st + j) * HD
    mask = move[:, None] & (cols < HD)[None, :]
    base = layer * stride_l + b * stride_b
    k = tl.load(k_ptr + base + src[:, None] + cols[None, :], mask=mask)
    v = tl.load(v_ptr + base + src[:, None] + cols[None, :], mask=mask)
    tl.debug_barrier()  # every source read lands before any destination is written
    tl.store(k_ptr + base + dst[:, None] + cols[None, :], k, mask=mask)
    tl.store(v_ptr + base + dst[:, None] + cols[None, :], v, mask=mask)


def kv_compact(
    k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    start: torch.Tensor,  # [B] int64, slot of the tree root per row
    nodes: torch.Tensor,  # [B, M] int64, accepted node ids (root first), -1 = none
) -> None:
    """Triton twin of ``kv_compact_reference`` (in place, all layers, K and V).

    Requires the reference's path invariant (node ids increase along the path, ``nodes[b, k] >= k``)
    only as far as the reference does: every source is read before any destination is written.
    """
    require_triton()
    check_tensor("k_cache", k_cache, dtypes=FLOAT_DTYPES, ndim=5)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=k_cache.device)
    L, b_max, S, hkv, d = k_cache.shape
    check_tensor("nodes", nodes, dtypes=(torch.int64,), ndim=2, device=k_cache.device)
    B, M = nodes.shape
    if B > b_max:
        raise ValueError(f"nodes has {B} rows but the cache holds only {b_max}")
    check_tensor("start", start, dtypes=(torch.int64,), shape=(B,), device=k_cache.device)
    hd = hkv * d
    if B * M * L * hd == 0:
        return
    block_m = max(next_pow2(M), 2)
    block_c, num_warps = compact_config(hd, block_m, k_cache.dtype, k_cache.device)
    _kv_compact_kernel[(triton.cdiv(hd, block_c), B, L)](
        k_cache, v_cache, start, nodes, b_max * S * hd, S * hd,
        HD=hd, M=M, BLOCK_M=block_m, BLOCK_C=block_c, NONE=-1,
        num_warps=num_warps,
    )  # fmt: skip
