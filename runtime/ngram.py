"""Prompt lookup inside the draft tree: an n-gram branch grafted onto the drafter's tree.

Prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram`` method)
drafts by copying: find the last ``n`` tokens of the sequence earlier in it and propose what
followed. It wins where the output repeats the input (code edits, quoting, extraction) and loses
where it does not; an EAGLE drafter is the other way round. Here both run in the same round: the
drafter's EAGLE-2 tree, plus one chain of up to ``M`` looked-up tokens grafted onto it, verified by
the same target forward. Acceptance is that of the better proposal on each round, for ``M`` more
verified rows.

Per row, with the sequence ``x[0..L]`` (``x[L]`` the root: the last emitted token)::

    lookup  for n = n_max .. n_min: the occurrences p of the suffix x[L-n+1..L] at p <= L-n;
            take the last one whose continuation x[p+n .. p+n+M-1] is known (<= L) in full,
            else the last one; the first n with an occurrence wins. g = x[p+n ..], cut at x[L]
    graft   walk g down the tree from the root: while g[k] is a child of the current node,
            follow it; from the first g[k] that is not, append g[k..] as nodes N, N+1, .., a
            chain under the last node matched (node N+r has depth k+r+1); the M-len(g)+k nodes
            left over are padding, which eager CPU rounds cut off before verifying

Siblings stay distinct, so both greedy verification (first matching child) and lossless tree
sampling (sampling without replacement over the children, ``kernels/verify_sampling.py``) accept
the looked-up tokens exactly as they accept drafted ones: the output is unchanged. Everything is
fixed-shape tensor work (no host sync), so it runs inside captured and compiled rounds.
"""

from __future__ import annotations

import torch


def ngram_lookup(
    hist: torch.Tensor,  # [B, S] int64 tokens by position; x[L] = the root, positions > L unused
    L: torch.Tensor,  # [B] int64 position of the root
    num_tokens: int,
    n_max: int,
    n_min: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, M], valid [B, M])``: the continuation of the suffix's latest earlier
    occurrence (module docstring); ``valid`` is a prefix of each row (False: nothing to propose).

    One pass over the window ends q < L: ``run[q]`` = how many tokens ending at q equal the
    suffix's (up to ``n_max``); the best q maximises (run, whole continuation known, q), which is
    the reference's order (longest n, then a whole continuation, then the latest)."""
    B, S = hist.shape
    M, dev = num_tokens, hist.device
    j = torch.arange(n_max, device=dev)
    back = L[:, None] - j  # [B, n_max] positions L, L-1, ..
    suffix = torch.where(back >= 0, hist.gather(1, back.clamp(min=0)), -2)  # -2: before the sequence
    padded = torch.cat([torch.full((B, n_max - 1), -1, dtype=hist.dtype, device=dev), hist], 1)
    win = padded.unfold(1, n_max, 1).flip(-1)  # [B, S, n_max]: tokens at q, q-1, ..
    run = (win == suffix[:, None, :]).cumprod(-1).sum(-1)  # [B, S]
    q = torch.arange(S, device=dev)[None, :]
    ok = (run >= n_min) & (q < L[:, None])
    score = torch.where(ok, run * (4 * S) + (q + M <= L[:, None]) * (2 * S) + q, -1)
    best = score.max(1).values  # [B]
    cpos = (best % S + 1)[:, None] + torch.arange(M, device=dev)  # [B, M] continuation positions
    valid = (best >= 0)[:, None] & (cpos <= L[:, None])
    return hist.gather(1, cpos.clamp(max=S - 1)), valid


def ngram_lookup_reference(seq: list[int], num_tokens: int, n_max: int, n_min: int) -> list[int]:
    """The lookup of one sequence (root last) in plain Python: the tokens ``ngram_lookup`` proposes."""
    L = len(seq) - 1
    for n in range(n_max, n_min - 1, -1):
        if n > L:
            continue
        suffix = seq[L - n + 1 :]
        starts = [p for p in range(L - n + 1) if seq[p : p + n] == suffix]
        if starts:
            whole = [p for p in starts if p + n + num_tokens - 1 <= L]
            p = (whole or starts)[-1]
            return seq[p + n : p + n + num_tokens]
    return []


def graft_chain(
    tokens: torch.Tensor,  # [B, N] node tokens, node 0 = root
    parents: torch.Tensor,  # [B, N] parent node, -1 = root / padding
    depth: torch.Tensor,  # [B, N] node depth (root 0)
    mask: torch.Tensor,  # [B, N, N] bool ancestor-or-self
    chain: torch.Tensor,  # [B, M] tokens to graft below the root
    valid: torch.Tensor,  # [B, M] bool, a prefix per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree with ``chain`` grafted below the root: ``(tokens, parents, depth, mask)`` of
    ``N + M`` nodes, and ``added [B]``, the nodes grafted per row. The longest prefix of ``chain``
    that is a path of the tree is followed (to node ``a`` at depth ``k``); the rest of the valid
    chain becomes nodes ``N .. N + added - 1``, a chain under ``a``. The other nodes ``N + r`` are
    padding (parent -1, the root's token, seeing the root and themselves), so a caller may cut
    the tree to ``N + max(added)`` nodes.

    Without a loop over nodes: a node lies on the chain's path when every ancestor ``u`` (root
    excluded) holds ``chain[depth(u) - 1]``; siblings hold distinct tokens (a top-k), so at most
    one node per depth does, and ``a`` is the deepest."""
    B, N = tokens.shape
    M = chain.shape[1]
    dev = tokens.device
    T = N + M
    is_node = (parents >= 0) | (torch.arange(N, device=dev) == 0)[None, :]
    d = depth.clamp(1, M) - 1  # [B, N] chain index a node at this depth would hold
    on = (tokens == chain.gather(1, d)) & valid.gather(1, d) & (depth <= M) & is_node
    on[:, 0] = True  # the root
    path = ~(mask & ~on[:, None, :]).any(-1) & is_node  # [B, N] every ancestor-or-self on the chain
    score = torch.where(path, depth, -1)
    k = score.max(1).values  # [B] chain tokens already in the tree
    a = torch.where(score == k[:, None], torch.arange(N, device=dev), N).min(1).values  # [B] the node reached
    added = valid.sum(1) - k  # [B]
    r = torch.arange(M, device=dev)[None, :]  # [1, M] grafted node N + r holds chain[k + r]
    new = r < added[:, None]  # [B, M]
    new_par = torch.where(new, torch.where(r == 0, a[:, None], N + r - 1), -1)
    par = torch.cat([parents, new_par], 1)  # [B, T]
    g = chain.gather(1, (k[:, None] + r).clamp(max=M - 1))
    tok = torch.cat([tokens, torch.where(new, g, tokens[:, :1])], 1)
    dep = torch.cat([depth, torch.where(new, k[:, None] + r + 1, 1)], 1)
    anc = mask.gather(1, a[:, None, None].expand(B, 1, N))[:, 0]  # [B, N] ancestors-or-self of a
    col = torch.arange(T, device=dev)[None, None, :]  # [1, 1, T]
    own = (col >= N) & (col <= N + r[..., None])  # [1, M, T] grafted nodes up to this one
    rows = torch.cat([anc[:, None, :].expand(B, M, N), torch.zeros(B, M, M, dtype=torch.bool, device=dev)], 2) | own
    rows = torch.where(new[..., None], rows, (col == N + r[..., None]) | (col == 0))
    out = torch.cat([torch.cat([mask, torch.zeros(B, N, M, dtype=torch.bool, device=dev)], 2), rows], 1)
    return tok, par, dep, out, added
