"""Greedy tree verification.

Node 0 is the root (the last emitted token, not yet in the cache); nodes ``1..N-1`` are draft
tokens with ``parents[b, i] < i`` (``-1`` marks a padding node that is not in the tree).
``target_argmax[b, i]`` is the target's greedy next token after node i. Walk from the root:

    cur = 0
    repeat up to max_depth times:
        c = first child of cur (lowest node id) with tokens[c] == target_argmax[cur]
        if none: stop
        accept c; cur = c
    bonus = target_argmax[cur]

Outputs per row: ``nodes`` (root + accepted node ids, -1 padded), ``num_accepted`` (accepted
draft tokens, root excluded) and ``emitted`` (accepted draft tokens then the bonus token, -1
padded): at least one new token per round.
"""
from __future__ import annotations

import torch


def verify_greedy_reference(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
    target_argmax: torch.Tensor,  # [B, N] int64
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(nodes [B, max_depth+1], num_accepted [B], emitted [B, max_depth+1])``."""
    batch, n = tokens.shape
    dev = tokens.device
    ar = torch.arange(n, device=dev)
    nodes = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=dev)
    emitted = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.int64, device=dev)
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    num = torch.zeros(batch, dtype=torch.int64, device=dev)
    is_node = (parents >= 0) & (ar[None, :] > 0)
    for depth in range(1, max_depth + 1):
        want = target_argmax.gather(1, cur[:, None])  # [B, 1]
        ok = is_node & (parents == cur[:, None]) & (tokens == want)  # [B, N]
        first = torch.where(ok, ar[None, :], n).min(dim=1).values  # [B]
        hit = alive & (first < n)
        cur = torch.where(hit, first, cur)
        nodes[:, depth] = torch.where(hit, first, -1)
        emitted[:, depth - 1] = torch.where(hit, tokens.gather(1, first.clamp(max=n - 1)[:, None])[:, 0], -1)
        num = num + hit.long()
        alive = hit
    bonus = target_argmax.gather(1, cur[:, None])[:, 0]
    emitted.scatter_(1, num[:, None], bonus[:, None])
    return nodes, num, emitted
