"""Lossless stochastic tree verification (multi-candidate, sampling without replacement).

The draft nodes under a tree node are deterministic top-k picks of the drafter, so the lossless
rule is *sampling without replacement against the target distribution p* (SpecInfer/EAGLE,
``../shared/reference/eagle-spec.md`` §6.2). One pass over the nodes in id order (a child's id
is always larger than its parent's, siblings are visited in id order):

    cur = 0 (the root); r = p[cur]                            (r: residual, unnormalised)
    for j = 1 .. N-1:
        if parents[j] != cur: continue                         (not a child of the current node)
        c = tokens[j]
        if u[j] * mass(r) <= q(r[c]) and q(r[c]) > 0:           (accept with prob r[c] / sum(r))
            cur = j; r = p[j]                                  (descend; fresh distribution)
        else:
            r[c] = 0                                           (remove c, i.e. renormalise)
    bonus = argmax_v r[v] / xi[v]                              (exponential race: a sample of r)

Child c_i is chosen with probability r(c_i)/sum(r), and when every child is rejected the final
token is drawn from p conditioned on "not a rejected child"; so the token emitted at each node is
distributed exactly as p, and by induction the whole output is. ``u`` ~ U(0,1) ``[B, N]`` (one
coin per node, used when the node is tried as a child) and ``xi`` ~ Exp(1) ``[B, V]`` are passed
in, so the op is deterministic given them and can run inside a CUDA graph (no ``multinomial``).

Exactly reproducible arithmetic (the Triton kernel equals this reference bit for bit)
-------------------------------------------------------------------------------------
A float sum over V depends on the reduction order, which differs between torch's CPU kernels,
its CUDA kernels, the Triton interpreter and the compiled kernel. So the mass is kept in fixed
point: ``q(x) = trunc(x * 2^48)`` as int64 (the multiply by a power of two is exact) and
``mass(r) = sum_v q(r[v])``, an integer sum, exact in any order. The coin test is
``float64(u) * float64(mass) <= float64(q(r[c]))``: one correctly rounded fp64 multiply (mass
< 2^53 for probability rows, so both conversions are exact). Truncation drops less than 2^-48
per token (< 5e-10 in total at V = 128K), far below the fp32 rounding of p itself. Rows of
``probs`` must be probabilities (each row summing to well under 2^15, or the fixed point
overflows). The bonus compares ``r[v] / xi[v]`` (one correctly rounded division, monotone like
the textbook ``log r - log xi``, whose ``log`` is not correctly rounded on a GPU); the first
maximal index wins, as ``torch.argmax``. ``xi`` must be > 0 (``RowRandom`` clamps it).
"""

from __future__ import annotations

import torch

from .utils import ENABLE_FP_FUSION, argmax_update, check_tensor, next_pow2, require_triton, sampling_config, tl, triton

FIXED_ONE = 2.0**48  # fixed-point scale of the probability mass


def fixed_point(x: torch.Tensor) -> torch.Tensor:
    """``trunc(x * 2^48)`` as int64: probabilities in fixed point (sums are exact in any order)."""
    return (x.float() * FIXED_ONE).to(torch.int64)


def verify_sampling_reference(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
    probs: torch.Tensor,  # [B, N, V] float32 target probabilities after logits processing
    uniforms: torch.Tensor,  # [B, N] float32 in [0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32, Exp(1), > 0
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(nodes [B, max_depth+1], num_accepted [B], emitted [B, max_depth+1])`` as the greedy op."""
    B, N = tokens.shape
    dev = tokens.device
    nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int64, device=dev)
    emitted = torch.full((B, max_depth + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    r = probs[:, 0].float().clone()  # [B, V]
    rows = torch.arange(B, device=dev)
    for j in range(1, N):
        tok = tokens[:, j]
        is_child = (parents[:, j] == cur) & (num < max_depth)
        pc = r[rows, tok]
        qc = fixed_point(pc)
        mass = fixed_point(r).sum(-1)  # exact
        accept = is_child & (qc > 0) & (uniforms[:, j].double() * mass.double() <= qc.double())
        reject = is_child & ~accept
        r[rows, tok] = torch.where(reject, 0.0, pc)
        r = torch.where(accept[:, None], probs[:, j].float(), r)
        depth = (num + 1).clamp(max=max_depth)  # rows at full depth accept nothing more
        nodes.scatter_(1, depth[:, None], torch.where(accept, j, nodes.gather(1, depth[:, None])[:, 0])[:, None])
        emitted.scatter_(1, num[:, None], torch.where(accept, tok, emitted.gather(1, num[:, None])[:, 0])[:, None])
        cur = torch.where(accept, j, cur)
        num = num + accept.long()
    bonus = (r / exp_noise).argmax(-1)
    emitted.scatter_(1, num[:, None], bonus[:, None])
    return nodes, num, emitted


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# One program per row. The reference's pass over nodes is regrouped by depth (the structure of
# the greedy kernel): everything the coin test needs except the mass of the current node's row
# is fixed by the tree, so it is computed once, vectorised over the nodes:
#
#   q[j]      = q(p[parents[j], tokens[j]])         the candidate's fixed-point mass (a gather)
#   dup[j]    = an earlier sibling carries tokens[j] (already removed when j is tried: r[c] = 0)
#   before[j] = sum of q[k] over earlier siblings k that are not dups (the mass they removed)
#
# When node j is tried, its earlier siblings were all tried and rejected (otherwise the walk
# would have descended into one of them), so the residual's mass is exactly
# ``mass(p[cur]) - before[j]`` in integers. The loop over depth (bound MAX_DEPTH, constexpr)
# accepts the lowest-id child passing its coin test and, on a hit, sums the new row's mass in one
# blockwise pass over V. At the end the rejected children of the final node (all its children,
# unless the depth ran out) are the tokens removed from its residual: they are marked in a zeroed
# [B, V] int8 scratch row, and a blockwise pass over V takes the argmax of r / xi with the marked
# tokens at 0. The marks are written and read back by different threads of the program, hence the
# barrier between them (a no-op in the interpreter).
#
# Work per row: (1 + accepted) passes over V for the masses, one pass for the bonus, and
# O(BLOCK_N^2) register work for dup/before (BLOCK_N = next_pow2(N): cheap for the tree sizes in
# use, tens of nodes; trees of hundreds of nodes spill registers but stay exact).
# --------------------------------------------------------------------------------------------
@triton.jit
def _row_mass(row_ptr, V, BLOCK_V: tl.constexpr, ONE: tl.constexpr):
    """``sum_v trunc(row[v] * ONE)`` in int64 (exact: integer addition is associative)."""
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + v0 + cols, mask=v0 + cols < V, other=0.0)
        acc += (x * ONE).to(tl.int64)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["N"])
def _verify_sampling_kernel(
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int64
    probs_ptr,  # [B, N, V] fp32
    u_ptr,  # [B, N] fp32
    xi_ptr,  # [B, V] fp32
    mark_ptr,  # [B, V] int8 scratch, zeroed
    nodes_ptr,  # [B, MAX_DEPTH+1] int64 out
    num_ptr,  # [B] int64 out
    emitted_ptr,  # [B, MAX_DEPTH+1] int64 out
    N,
    V,
    MAX_DEPTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ONE: tl.constexpr,
    NONE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = MAX_DEPTH + 1
    ar = tl.arange(0, BLOCK_N)
    in_row = ar < N
    tok = tl.load(tokens_ptr + b * N + ar, mask=in_row, other=0)
    par = tl.load(parents_ptr + b * N + ar, mask=in_row, other=NONE)
    u = tl.load(u_ptr + b * N + ar, mask=in_row, other=1.0)
    is_node = in_row & (par >= 0) & (ar > 0)
    in_vocab = (tok >= 0) & (tok < V)
    p = tl.load(probs_ptr + (b * N + tl.maximum(par, 0)) * V + tok, mask=is_node & in_vocab, other=0.0)
    q = (p * ONE).to(tl.int64)

    # dup / before over pairs (j, k): k an earlier sibling of j (rows j, columns k)
    sib = (ar[None, :] < ar[:, None]) & is_node[None, :] & (par[None, :] == par[:, None])
    dup = tl.max((sib & (tok[None, :] == tok[:, None])).to(tl.int32), axis=1) > 0
    first_of_token = is_node & ~dup
    before = tl.sum(tl.where(sib & first_of_token[None, :], q[None, :], 0), axis=1)
    candidate = first_of_token & (q > 0)
    u64 = u.to(tl.float64)
    q64 = q.to(tl.float64)

    w = tl.arange(0, BLOCK_W)
    nodes = tl.where(w == 0, 0, tl.full([BLOCK_W], NONE, tl.int64))
    emitted = tl.full([BLOCK_W], NONE, tl.int64)
    cur = tl.zeros([], tl.int64)
    num = tl.zeros([], tl.int64)
    mass = _row_mass(probs_ptr + b * N * V, V, BLOCK_V, ONE)
    for depth in range(1, MAX_DEPTH + 1):
        ok = candidate & (par == cur) & (u64 * (mass - before).to(tl.float64) <= q64)
        first = tl.min(tl.where(ok, ar, N), axis=0).to(tl.int64)
        hit = first < N
        if hit:
            mass = _row_mass(probs_ptr + (b * N + first) * V, V, BLOCK_V, ONE)
        first_tok = tl.load(tokens_ptr + b * N + tl.minimum(first, N - 1))
        cur = tl.where(hit, first, cur)
        nodes = tl.where(w == depth, tl.where(hit, first, NONE), nodes)
        emitted = tl.where(w == depth - 1, tl.where(hit, first_tok, NONE), emitted)
        num = num + hit.to(tl.int64)

    # bonus: argmax_v r[v] / xi[v], r = p[cur] without the rejected children's tokens
    # (once the depth ran out no child was tried; a where, not `vector & scalar`: the interpreter
    # turns a bool vector & bool scalar into int32, which tl.store rejects as a mask)
    gone = is_node & in_vocab & (par == tl.where(num < MAX_DEPTH, cur, NONE))
    tl.store(mark_ptr + b * V + tok, tl.full([BLOCK_N], 1, tl.int8), mask=gone)
    tl.debug_barrier()
    cols = tl.arange(0, BLOCK_V)
    best = tl.full([], -1.0, tl.float32)
    best_v = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + cols < V
        r = tl.load(probs_ptr + (b * N + cur) * V + v0 + cols, mask=m, other=0.0)
        removed = tl.load(mark_ptr + b * V + v0 + cols, mask=m, other=0)
        xi = tl.load(xi_ptr + b * V + v0 + cols, mask=m, other=1.0)
        val = tl.where(m, tl.div_rn(tl.where(removed != 0, 0.0, r), xi), -1.0)
        best, best_v = argmax_update(val, v0, best, best_v)
    emitted = tl.where(w == num, best_v, emitted)
    tl.store(nodes_ptr + b * W + w, nodes, mask=w < W)
    tl.store(emitted_ptr + b * W + w, emitted, mask=w < W)
    tl.store(num_ptr + b, num)


def verify_sampling(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
    probs: torch.Tensor,  # [B, N, V] float32
    uniforms: torch.Tensor,  # [B, N] float32 in [0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32, > 0
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``verify_sampling_reference``: ``(nodes, num_accepted, emitted)``, bit for bit.

    ``max_depth`` is a compile-time constant (one compilation per tree depth, none per call).
    """
    require_triton()
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = tokens.shape
    dev = tokens.device
    check_tensor("parents", parents, dtypes=(torch.int64,), shape=(B, N), device=dev)
    check_tensor("probs", probs, dtypes=(torch.float32,), ndim=3, device=dev)
    V = probs.shape[-1]
    check_tensor("probs", probs, shape=(B, N, V))
    check_tensor("uniforms", uniforms, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("exp_noise", exp_noise, dtypes=(torch.float32,), shape=(B, V), device=dev)
    max_depth = int(max_depth)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if N < 1:
        raise ValueError("tokens must hold at least the root (N >= 1)")
    if V < 1:
        raise ValueError("probs must have a non-empty vocabulary axis")
    nodes = torch.empty((B, max_depth + 1), dtype=torch.int64, device=dev)
    num = torch.empty((B,), dtype=torch.int64, device=dev)
    emitted = torch.empty((B, max_depth + 1), dtype=torch.int64, device=dev)
    if B == 0:
        return nodes, num, emitted
    mark = torch.zeros((B, V), dtype=torch.int8, device=dev)
    block_v, warps = sampling_config(V)
    _verify_sampling_kernel[(B,)](
        tokens, parents, probs, uniforms, exp_noise, mark, nodes, num, emitted, N, V,
        MAX_DEPTH=max_depth, BLOCK_N=max(next_pow2(N), 16), BLOCK_W=max(next_pow2(max_depth + 1), 16),
        BLOCK_V=block_v, ONE=FIXED_ONE, NONE=-1,
        num_warps=warps, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return nodes, num, emitted
