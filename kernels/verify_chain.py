"""Lossless verification of a *sampled* draft chain (standard speculative sampling).

The drafter sampled ``x_i ~ q_i`` for depths ``i = 1..n`` (a chain, ``top_k = 1``, temperature
> 0); ``p_{i-1}`` is the target's distribution at node ``i-1`` (the one that predicts ``x_i``):

    for i = 1 .. n:
        accept x_i with probability min(1, p_{i-1}(x_i) / q_i(x_i))        (u_i * q <= p)
        on the first rejection: emit a sample of norm(max(0, p_{i-1} - q_i)) and stop
    all accepted: emit a sample of p_n (the bonus token)

Each emitted token is distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023;
``../shared/reference/eagle-spec.md`` §6): P(emit v) = min(p, q)(v) + (1 - Σ min(p, q)) ·
max(0, p - q)(v) / Σ max(0, p - q) = p(v). ``u`` ~ U(0,1) ``[B, n+1]`` (column i is depth i's
coin; column 0 unused) and ``xi`` ~ Exp(1) ``[B, V]`` are passed in, so the op is deterministic
given them and runs inside a CUDA graph. The residual sample is the exponential race
``argmax_v r[v] / xi[v]`` (first maximal index wins, as ``torch.argmax``); when the residual is
all zero (p == q to the last bit, so a rejection had probability 0) it falls back to p.

Exactly reproducible arithmetic: the coin test is ``float64(u) * float64(q) <= float64(p)``
(exact: a product of two fp32 values fits in fp64), the residual ``max(p - q, 0)`` and the race
``r / xi`` are single correctly rounded fp32 operations, and the all-zero test is a max: so the
Triton kernel equals this reference bit for bit.
"""

from __future__ import annotations

import torch

from .utils import ENABLE_FP_FUSION, argmax_update, check_tensor, next_pow2, require_triton, sampling_config, tl, triton


def verify_chain_reference(
    tokens: torch.Tensor,  # [B, n+1] int64, node 0 = root, node i = the depth-i draft
    probs: torch.Tensor,  # [B, n+1, V] float32 target probabilities (after logits processing)
    draft_probs: torch.Tensor,  # [B, n, V] float32, row i-1 = q_i, the distribution x_i was drawn from
    uniforms: torch.Tensor,  # [B, n+1] float32 in [0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32, Exp(1), > 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(nodes [B, n+1], num_accepted [B], emitted [B, n+1])`` as the tree verifiers do."""
    B, N = tokens.shape
    n = N - 1
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    emitted = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    for i in range(1, N):
        x = tokens[:, i]
        p = probs[rows, i - 1, x].double()
        q = draft_probs[rows, i - 1, x].double()
        acc = alive & (q > 0) & (uniforms[:, i].double() * q <= p)
        emitted[:, i - 1] = torch.where(acc, x, -1)
        num = num + acc.long()
        alive = acc
    ar = torch.arange(N, device=dev)
    nodes = torch.where(ar[None, :] <= num[:, None], ar[None, :], -1)
    p_at = probs[rows, num]  # [B, V] the distribution at the last accepted node
    q_at = draft_probs[rows, num.clamp(max=max(n - 1, 0))] if n > 0 else torch.zeros_like(p_at)
    rejected = (num < n)[:, None]
    r = torch.where(rejected, (p_at - q_at).clamp(min=0.0), p_at)
    r = torch.where(r.amax(-1, keepdim=True) > 0, r, p_at)
    bonus = (r / exp_noise).argmax(-1)
    emitted.scatter_(1, num[:, None], bonus[:, None])
    return nodes, num, emitted


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# One program per row: the depth loop (compile-time bound N_DRAFT) loads p and q at each draft
# token and keeps the acceptance in registers; then one pass over V for the residual's maximum
# (the all-zero fallback) and one for the race, blockwise, with the first maximal index kept
# across blocks (a strict comparison, ``utils.argmax_update``), as torch.argmax.
# --------------------------------------------------------------------------------------------
@triton.jit
def _verify_chain_kernel(
    tokens_ptr,  # [B, N] int64
    probs_ptr,  # [B, N, V] fp32
    q_ptr,  # [B, N-1, V] fp32
    u_ptr,  # [B, N] fp32
    xi_ptr,  # [B, V] fp32
    nodes_ptr,  # [B, N] int64 out
    num_ptr,  # [B] int64 out
    emitted_ptr,  # [B, N] int64 out
    V,
    N_DRAFT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = N_DRAFT + 1
    w = tl.arange(0, BLOCK_W)
    emitted = tl.full([BLOCK_W], -1, tl.int64)
    num = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int1)
    for i in tl.static_range(1, N):
        x = tl.load(tokens_ptr + b * N + i)
        px = tl.load(probs_ptr + (b * N + i - 1) * V + x).to(tl.float64)
        qx = tl.load(q_ptr + (b * N_DRAFT + i - 1) * V + x).to(tl.float64)
        u = tl.load(u_ptr + b * N + i).to(tl.float64)
        acc = alive & (qx > 0) & (u * qx <= px)
        emitted = tl.where(w == i - 1, tl.where(acc, x, -1), emitted)
        num = num + acc.to(tl.int64)
        alive = acc
    nodes = tl.where(w <= num, w.to(tl.int64), -1)
    rejected = num < N_DRAFT
    p_row = probs_ptr + (b * N + num) * V
    q_row = q_ptr + (b * N_DRAFT + tl.minimum(num, N_DRAFT - 1)) * V
    cols = tl.arange(0, BLOCK_V)
    top = tl.zeros([], tl.float32)  # max of the residual (0: fall back to p)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + cols < V
        p = tl.load(p_row + v0 + cols, mask=m, other=0.0)
        q = tl.load(q_row + v0 + cols, mask=m, other=0.0)  # q_row is a valid row even when nothing was rejected
        r = tl.where(rejected, tl.maximum(p - q, 0.0), p)
        top = tl.maximum(top, tl.max(tl.where(m, r, 0.0), axis=0))
    use_p = top <= 0.0
    best = tl.full([], -1.0, tl.float32)
    best_v = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + cols < V
        p = tl.load(p_row + v0 + cols, mask=m, other=0.0)
        q = tl.load(q_row + v0 + cols, mask=m, other=0.0)  # q_row is a valid row even when nothing was rejected
        r = tl.where(rejected & ~use_p, tl.maximum(p - q, 0.0), p)
        xi = tl.load(xi_ptr + b * V + v0 + cols, mask=m, other=1.0)
        val = tl.where(m, tl.div_rn(r, xi), -1.0)
        best, best_v = argmax_update(val, v0, best, best_v)
    emitted = tl.where(w == num, best_v, emitted)
    tl.store(nodes_ptr + b * N + w, nodes, mask=w < N)
    tl.store(emitted_ptr + b * N + w, emitted, mask=w < N)
    tl.store(num_ptr + b, num)


def verify_chain(
    tokens: torch.Tensor,  # [B, n+1] int64
    probs: torch.Tensor,  # [B, n+1, V] float32
    draft_probs: torch.Tensor,  # [B, n, V] float32
    uniforms: torch.Tensor,  # [B, n+1] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of ``verify_chain_reference``: ``(nodes, num_accepted, emitted)``, bit for bit.
    The chain length is a compile-time constant (one compilation per depth, none per call)."""
    require_triton()
    check_tensor("tokens", tokens, dtypes=(torch.int64,), ndim=2)
    B, N = tokens.shape
    if N < 2:
        raise ValueError("a sampled chain needs at least one drafted token (tokens of shape [B, n+1], n >= 1)")
    dev = tokens.device
    check_tensor("probs", probs, dtypes=(torch.float32,), ndim=3, device=dev)
    V = probs.shape[-1]
    check_tensor("probs", probs, shape=(B, N, V))
    check_tensor("draft_probs", draft_probs, dtypes=(torch.float32,), shape=(B, N - 1, V), device=dev)
    check_tensor("uniforms", uniforms, dtypes=(torch.float32,), shape=(B, N), device=dev)
    check_tensor("exp_noise", exp_noise, dtypes=(torch.float32,), shape=(B, V), device=dev)
    nodes = torch.empty((B, N), dtype=torch.int64, device=dev)
    num = torch.empty((B,), dtype=torch.int64, device=dev)
    emitted = torch.empty((B, N), dtype=torch.int64, device=dev)
    if B == 0:
        return nodes, num, emitted
    block_v, warps = sampling_config(V)
    _verify_chain_kernel[(B,)](
        tokens, probs, draft_probs, uniforms, exp_noise, nodes, num, emitted, V,
        N_DRAFT=N - 1, BLOCK_W=max(next_pow2(N), 16), BLOCK_V=block_v,
        num_warps=warps, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return nodes, num, emitted
