"""EAGLE-2 dynamic draft tree: expansion of the best top_k per level, global rerank, tree build.

Candidates of one round, per row, in level order (``C = K + (D-1)·K²``):

    level 1:  K candidates (top-K of the first draft distribution), parent = root
    level l:  K² candidates, offset ``K + (l-2)·K²``; candidate j's parent is frontier node
              j // K of level l-1; score = parent score + log q (cumulative log-probability)

The frontier of each level is its best K candidates. Rerank keeps the best ``N-1`` of all C
candidates (``N = num_draft_tokens``, root included), sorted back into candidate order. Ties
break towards the lower candidate index (a stable sort), and a child's score never exceeds its
parent's, so a kept node's parent is always kept and comes first.
"""

from __future__ import annotations

import torch


def topk_stable(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis; ties go to the lower index (deterministic on every backend)."""
    values, index = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], index[..., :k]


def rerank(scores: torch.Tensor, num_keep: int) -> torch.Tensor:
    """``scores [B, C]`` -> kept candidate ids ``[B, num_keep]`` in ascending (level) order."""
    _, keep = topk_stable(scores, num_keep)
    return keep.sort(dim=-1).values


def build_tree(
    keep: torch.Tensor,  # [B, N-1] kept candidate ids, ascending
    cand_parent: torch.Tensor,  # [B, C] parent candidate id, -1 = root
    cand_depth: torch.Tensor,  # [C] depth of each candidate (1-based)
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node arrays for verification, node 0 = root: ``(parents [B, N], depth [B, N], mask [B, N, N])``.

    ``mask[b, i, j]`` is true when node j is node i or one of its ancestors.
    """
    B, n_keep = keep.shape
    N = n_keep + 1
    dev = keep.device
    node_of = torch.full(cand_parent.shape, -1, dtype=torch.int64, device=dev)  # [B, C]
    node_of.scatter_(1, keep, torch.arange(1, N, device=dev).expand(B, -1))
    pc = cand_parent.gather(1, keep)  # [B, N-1]
    par = torch.where(pc >= 0, node_of.gather(1, pc.clamp(min=0)), 0)
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), par], dim=1)
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), cand_depth[keep]], dim=1)
    # column N is a trash column for "no ancestor", so the loop needs no host-side indexing
    mask = torch.zeros(B, N, N + 1, dtype=torch.bool, device=dev)
    anc = torch.arange(N, device=dev).expand(B, N)
    for _ in range(max_depth + 1):  # self, then up the parent chain to the root
        mask.scatter_(2, torch.where(anc >= 0, anc, N)[..., None], True)
        anc = torch.where(anc >= 0, parents.gather(1, anc.clamp(min=0)), -1)
    return parents, depth, mask[..., :N]
