"""Draft-tree construction: rerank keeps parents, masks are ancestor sets, depths add up."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.runtime.tree import build_tree, rerank, topk_stable


def synthetic_candidates(K: int, D: int, seed: int, ties: bool):
    """Candidate arrays laid out as the drafter produces them (level 1: K, then K^2 per level)."""
    g = torch.Generator().manual_seed(seed)
    parents, depths, scores = [torch.full((K,), -1)], [torch.ones(K, dtype=torch.int64)], []
    s1 = -torch.rand(K, generator=g)
    if ties:
        s1 = s1.round(decimals=1)
    scores.append(s1)
    frontier, fscore, offset = torch.arange(K), s1, K
    for lvl in range(2, D + 1):
        lp = -torch.rand(K, K, generator=g)
        if ties:
            lp = (lp.round(decimals=1) * (lp > -0.3)).clamp(max=0)  # many exact zeros: child score == parent
        cum = (fscore[:, None] + lp).reshape(-1)
        scores.append(cum)
        parents.append(frontier.repeat_interleave(K))
        depths.append(torch.full((K * K,), lvl))
        fscore, sel = topk_stable(cum, K)
        frontier = offset + sel
        offset += K * K
    return torch.cat(scores)[None], torch.cat(parents)[None], torch.cat(depths)


@settings(max_examples=60, deadline=None)
@given(
    K=st.integers(1, 5), D=st.integers(1, 5), frac=st.floats(0.01, 1.0), seed=st.integers(0, 10_000), ties=st.booleans()
)
def test_tree_is_parent_closed_with_ancestor_masks(K, D, frac, seed, ties):
    scores, cparent, cdepth = synthetic_candidates(K, D, seed, ties)
    C = scores.shape[1]
    n_keep = max(1, int(frac * C))
    keep = rerank(scores, n_keep)
    parents, depth, mask = build_tree(keep, cparent, cdepth, D)
    N = n_keep + 1
    assert parents[0, 0] == -1 and depth[0, 0] == 0
    for i in range(1, N):
        p = int(parents[0, i])
        assert 0 <= p < i, "a kept node's parent is kept and comes first"
        assert depth[0, i] == depth[0, p] + 1
        want = mask[0, p].clone()
        want[i] = True
        assert torch.equal(mask[0, i], want), "row i = row parent(i) OR e_i"
    assert torch.equal(mask[0].sum(-1), depth[0] + 1)
    # the kept set is a best-N set: no dropped candidate scores above a kept one
    kept = torch.zeros(C, dtype=torch.bool)
    kept[keep[0]] = True
    if not kept.all():
        assert scores[0, kept].min() >= scores[0, ~kept].max()


def test_chain_tree_is_a_path():
    scores, cparent, cdepth = synthetic_candidates(1, 6, 0, False)
    keep = rerank(scores, 6)
    parents, depth, mask = build_tree(keep, cparent, cdepth, 6)
    assert parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert torch.equal(mask[0], torch.ones(7, 7, dtype=torch.bool).tril())


def test_specconfig_validation():
    assert ts.SpecConfig.chain(3) == ts.SpecConfig(3, 1, 4)
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be >= 1"):
        ts.SpecConfig(0, 1, 2)
    with pytest.raises(ValueError, match="num_draft_tokens=1 must be >= 2"):
        ts.SpecConfig(2, 2, 1)
    with pytest.raises(ValueError, match="drafts only 3 candidates"):
        ts.SpecConfig.chain(3).__class__(3, 1, 5)


def test_torch_backend_attention_equals_the_reference():
    """TorchOps.tree_attention (mask built once per forward, broadcast GQA) computes the reference."""
    from tritonspec.kernels.tree_attention import tree_attention_reference
    from tritonspec.runtime.ops import TorchOps

    g = torch.Generator().manual_seed(0)
    B, Q, Hq, Hkv, D, S, T = 3, 5, 6, 2, 8, 40, 7
    q = torch.randn(B, Q, Hq, D, generator=g)
    k = torch.randn(B + 1, S, Hkv, D, generator=g)
    v = torch.randn(B + 1, S, Hkv, D, generator=g)
    prefix = torch.tensor([0, 9, 30])
    mask = torch.rand(B, Q, T, generator=g) < 0.5
    mask[..., 0] = True
    ops = TorchOps()
    for kv_len in (None, 37):
        want = tree_attention_reference(q, k, v, prefix, mask, 0.3, kv_len)
        torch.testing.assert_close(ops.tree_attention(q, k, v, prefix, mask, 0.3, kv_len), want, atol=1e-6, rtol=1e-5)
    other = mask.clone()
    other[0, 0] = ~other[0, 0]  # a new mask object must not reuse the cached visibility
    other[0, 0, 0] = True
    torch.testing.assert_close(
        ops.tree_attention(q, k, v, prefix, other, 0.3),
        tree_attention_reference(q, k, v, prefix, other, 0.3),
        atol=1e-6,
        rtol=1e-5,
    )
