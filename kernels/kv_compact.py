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
