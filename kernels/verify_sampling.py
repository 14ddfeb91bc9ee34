"""Lossless stochastic tree verification (multi-candidate, sampling without replacement).

The draft nodes under a tree node are deterministic top-k picks of the drafter, so the lossless
rule is *sampling without replacement against the target distribution p* (SpecInfer/EAGLE,
``../shared/reference/eagle-spec.md`` §6.2). One pass over the nodes in id order (a child's id
is always larger than its parent's, siblings are visited in id order):

    cur = 0 (the root); r = p[cur]                            (r: residual, unnormalised)
    for j = 1 .. N-1:
        if parents[j] != cur: continue                         (not a child of the current node)
        c = tokens[j]
        if u[j] * sum(r) <= r[c] and r[c] > 0:                 (accept with prob r[c] / sum(r))
            cur = j; r = p[j]                                  (descend; fresh distribution)
        else:
            r[c] = 0                                           (remove c, i.e. renormalise)
    bonus = argmax_v log r[v] - log xi[v]                      (exponential race: a sample of r)

Child c_i is chosen with probability r(c_i)/sum(r), and when every child is rejected the final
token is drawn from p conditioned on "not a rejected child"; so the token emitted at each node is
distributed exactly as p, and by induction the whole output is. ``u`` ~ U(0,1) ``[B, N]`` (one
coin per node, used when the node is tried as a child) and ``xi`` ~ Exp(1) ``[B, V]`` are passed
in, so the op is deterministic given them and can run inside a CUDA graph (no ``multinomial``).
"""
from __future__ import annotations

import torch


def verify_sampling_reference(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
    probs: torch.Tensor,  # [B, N, V] float32 target probabilities after logits processing
    uniforms: torch.Tensor,  # [B, N] float32 in [0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32, Exp(1)
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
    r = probs[:, 0].clone()  # [B, V]
    rows = torch.arange(B, device=dev)
    for j in range(1, N):
        tok = tokens[:, j]
        is_child = (parents[:, j] == cur) & (num < max_depth)
        pc = r[rows, tok]
        accept = is_child & (pc > 0) & (uniforms[:, j] * r.sum(-1) <= pc)
        reject = is_child & ~accept
        r[rows, tok] = torch.where(reject, 0.0, pc)
        r = torch.where(accept[:, None], probs[:, j], r)
        depth = (num + 1).clamp(max=max_depth)  # rows at full depth accept nothing more
        nodes.scatter_(1, depth[:, None], torch.where(accept, j, nodes.gather(1, depth[:, None])[:, 0])[:, None])
        emitted.scatter_(1, num[:, None], torch.where(accept, tok, emitted.gather(1, num[:, None])[:, 0])[:, None])
        cur = torch.where(accept, j, cur)
        num = num + accept.long()
    bonus = (r.log() - exp_noise.log()).argmax(-1)
    emitted.scatter_(1, num[:, None], bonus[:, None])
    return nodes, num, emitted
