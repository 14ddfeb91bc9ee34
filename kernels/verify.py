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

from .store import tuned
from .utils import check_tensor, next_pow2, require_triton, tl, triton


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


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# One program per row. The row's tokens and parents sit in registers; a loop with the
# compile-time bound MAX_DEPTH walks the tree exactly as the reference does (lowest matching
# child id first), carrying the outputs in registers and storing each once at the end. No
# data-dependent early exit: a row that stopped keeps looping with ``alive`` false.
# --------------------------------------------------------------------------------------------
def verify_config(n: int, device: torch.device | None = None) -> int:
    """num_warps per tree size N (a discrete kernel: every config gives the same bits)."""
    return tuned("verify_greedy", n, {"num_warps": 1}, dtype="int64", device=device)["num_warps"]


@triton.jit(do_not_specialize=["N"])
def _verify_greedy_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int64
    argmax_ptr,  # [B, N] int64
    nodes_ptr,  # [B, MAX_DEPTH+1] int64 out
    num_ptr,  # [B] int64 out
    emitted_ptr,  # [B, MAX_DEPTH+1] int64 out
    N,
    MAX_DEPTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NONE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = MAX_DEPTH + 1
    ar = tl.arange(0, BLOCK_N)
    in_row = ar < N
    tok = tl.load(tokens_ptr + b * N + ar, mask=in_row, other=NONE)
    par = tl.load(parents_ptr + b * N + ar, mask=in_row, other=NONE)
    is_node = in_row & (par >= 0) & (ar > 0)
    w = tl.arange(0, BLOCK_W)
    nodes = tl.where(w == 0, 0, tl.full([BLOCK_W], NONE, tl.int64))
    emitted = tl.full([BLOCK_W], NONE, tl.int64)
    cur = tl.zeros([], tl.int64)
    num = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int32)
    for depth in range(1, MAX_DEPTH + 1):
        want = tl.load(argmax_ptr + b * N + cur)
        ok = is_node & (par == cur) & (tok == want)
        first = tl.min(tl.where(ok, ar, N), axis=0)
        hit = (alive != 0) & (first < N)
        first_tok = tl.load(tokens_ptr + b * N + tl.minimum(first, N - 1))
        cur = tl.where(hit, first.to(tl.int64), cur)
        nodes = tl.where(w == depth, tl.where(hit, first.to(tl.int64), NONE), nodes)
        emitted = tl.where(w == depth - 1, tl.where(hit, first_tok, NONE), emitted)
        num = num + hit.to(tl.int64)
        alive = hit.to(tl.int32)
    bonus = tl.load(argmax_ptr + b * N + cur)
    emitted = tl.where(w == num, bonus, emitted)
    tl.store(nodes_ptr + b * W + w, nodes, mask=w < W)
    tl.store(emitted_ptr + b * W + w, emitted, mask=w < W)
    tl.store(num_ptr + b, num)


def verify_greedy(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
    target_argmax: torch.Tensor,  # [B, N] int64
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``verify_greedy_reference``: ``(nodes, num_accepted, emitted)``.

    ``max_depth`` is a compile-time constant (one compilation per tree depth, none per call).
    """
    require_triton()
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = tokens.shape
    check_tensor("parents", parents, dtypes=(torch.int64,), shape=(B, N), device=tokens.device)
    check_tensor("target_argmax", target_argmax, dtypes=(torch.int64,), shape=(B, N), device=tokens.device)
    max_depth = int(max_depth)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if N < 1:
        raise ValueError("tokens must hold at least the root (N >= 1)")
    dev = tokens.device
    nodes = torch.empty((B, max_depth + 1), dtype=torch.int64, device=dev)
    num = torch.empty((B,), dtype=torch.int64, device=dev)
    emitted = torch.empty((B, max_depth + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return nodes, num, emitted
    _verify_greedy_kernel[(B,)](
        tokens, parents, target_argmax, nodes, num, emitted, N,
        MAX_DEPTH=max_depth, BLOCK_N=max(next_pow2(N), 16), BLOCK_W=max(next_pow2(max_depth + 1), 16), NONE=-1,
        num_warps=verify_config(N, dev),
    )  # fmt: skip
    return nodes, num, emitted
