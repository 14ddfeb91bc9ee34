"""Sampling tree verification kernel vs its reference: bit for bit on every drawn input.

Trees are drawn in the degenerate shapes too: root only, one chain at (and past) the maximum
depth, all nodes siblings, duplicate tokens among siblings (a second copy of a rejected token
can never be accepted), padding nodes and padding rows. Target rows are drawn to exercise every
branch of the rule: peaked on a child's token (deep acceptances, rows that stop at max depth),
exactly one-hot, zero or below-fixed-point probability on children (never accepted), flat rows
with constant noise (ties in the bonus argmax: the first index wins), and coins at 0 and at the
largest value ``torch.rand`` gives.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.verify_sampling import (  # noqa: E402
    FIXED_ONE,
    verify_sampling,
    verify_sampling_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ["random", "chain", "siblings", "root_only", "padding_row", "bushy", "dup_siblings"]
ROW_KINDS = ["peaked", "one_hot", "zero_children", "tiny_children", "soft", "flat"]
U_MAX = 1.0 - 2.0**-24  # the largest value torch.rand returns


def make_parents(shape: str, n: int, rnd) -> list[int]:
    parents = [-1] * n
    for i in range(1, n):
        if shape == "chain":
            parents[i] = i - 1
        elif shape in ("siblings", "dup_siblings"):
            parents[i] = 0
        elif shape in ("root_only", "padding_row"):
            parents[i] = -1
        elif shape == "bushy":
            parents[i] = rnd(min(i, 3))
        else:
            parents[i] = -1 if rnd(5) == 0 else rnd(i)
    return parents


def make_row(shape: str, kind: str, n: int, vocab: int, g: torch.Generator):
    """One row ``(tokens, parents, probs [n, vocab], uniforms [n], exp_noise [vocab])``."""
    rnd = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
    parents = make_parents(shape, n, rnd)
    tok0 = rnd(vocab)
    tokens = [tok0 if shape == "dup_siblings" else rnd(vocab) for _ in range(n)]
    probs = torch.softmax(torch.randn(n, vocab, generator=g) * 3, -1)
    for i in range(n):
        kids = [tokens[c] for c in range(1, n) if parents[c] == i]
        if kind in ("peaked", "one_hot") and kids:
            t = kids[rnd(len(kids))]
            if kind == "one_hot":
                probs[i] = 0.0
                probs[i, t] = 1.0
            else:
                probs[i] = 0.1 * probs[i]
                probs[i, t] += 0.9
        elif kind == "zero_children" and kids and len(set(kids)) < vocab:
            probs[i, kids] = 0.0
        elif kind == "tiny_children" and kids:
            probs[i, kids] = torch.tensor([0.5, 1.0, 2.0])[rnd(3)] / FIXED_ONE  # at the fixed-point resolution
        elif kind == "flat":
            probs[i] = 1.0
        probs[i] /= probs[i].sum()
    u = torch.rand(n, generator=g)
    u[torch.rand(n, generator=g) < 0.1] = 0.0
    u[torch.rand(n, generator=g) < 0.1] = U_MAX
    xi = torch.empty(vocab).exponential_(generator=g).clamp(min=torch.finfo(torch.float32).tiny)
    if kind == "flat":
        xi.fill_(1.0)
    return tokens, parents, probs, u, xi


@st.composite
def sampling_case(draw):
    batch = draw(st.integers(1, 4))
    n = draw(st.integers(1, 20))
    max_depth = draw(st.integers(0, 8))
    vocab = draw(st.sampled_from([1, 2, 3, 7, 50, 300]))  # tiny vocabularies: duplicate sibling tokens
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=batch, max_size=batch))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=batch, max_size=batch))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    rows = [make_row(s, k, n, vocab, g) for s, k in zip(shapes, kinds)]
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=DEVICE)
    parents = torch.tensor([r[1] for r in rows], dtype=torch.int64, device=DEVICE)
    stack = lambda k: torch.stack([r[k] for r in rows]).to(DEVICE)  # noqa: E731
    return tokens, parents, stack(2), stack(3), stack(4), max_depth


def _check(tokens, parents, probs, u, xi, max_depth):
    got = verify_sampling(tokens, parents, probs, u, xi, max_depth)
    want = verify_sampling_reference(tokens, parents, probs, u, xi, max_depth)
    for name, a, b in zip(("nodes", "num_accepted", "emitted"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    return got


@settings(max_examples=100, deadline=None)
@given(sampling_case())
def test_verify_sampling_matches_reference(case):
    _check(*case)


def _one_row(parents, tokens, probs, u, xi, max_depth):
    t = lambda x, dt: torch.tensor([x], dtype=dt, device=DEVICE)  # noqa: E731
    return _check(
        t(tokens, torch.int64),
        t(parents, torch.int64),
        t(probs, torch.float32),
        t(u, torch.float32),
        t(xi, torch.float32),
        max_depth,
    )


@pytest.mark.parametrize("max_depth", [1, 5, 9])
def test_chain_stops_at_max_depth(max_depth):
    """A one-hot chain longer than max_depth: accepted to exactly max_depth; the bonus is then
    drawn from the last accepted node's full row (no child was tried there)."""
    n, V = 11, 16
    tokens = [0] + list(range(1, n))
    probs = [[1.0 if v == i + 1 else 0.0 for v in range(V)] for i in range(n)]
    probs[max_depth] = [1.0 / V] * V
    xi = [1.0] * V
    xi[max_depth + 1] = 0.5  # the bonus: the next chain token, not removed at full depth
    nodes, num, emitted = _one_row(list(range(-1, n - 1)), tokens, probs, [0.5] * n, xi, max_depth)
    assert num.item() == max_depth and nodes[0].tolist() == list(range(max_depth + 1))
    assert emitted[0].tolist() == list(range(1, max_depth + 1)) + [max_depth + 1]


def test_rejected_siblings_leave_the_bonus_distribution():
    """Every child of the root rejected (coins at U_MAX): the bonus never repeats one of them,
    even where its r / xi would be the largest; duplicate sibling tokens are rejected for free."""
    V = 6
    probs = [[0.3, 0.3, 0.1, 0.1, 0.1, 0.1]] + [[1.0 / V] * V] * 4
    xi = [0.01, 0.01, 1.0, 1.0, 0.5, 1.0]
    nodes, num, emitted = _one_row([-1, 0, 0, 0, 0], [0, 1, 0, 1, 0], probs, [0.0] + [U_MAX] * 4, xi, 3)
    assert num.item() == 0 and emitted[0, 0].item() == 4


def test_coin_equal_to_the_acceptance_ratio_accepts():
    """u * mass == q(r[c]) exactly accepts (the test is <=): u = 0.5, two tokens of mass 1/2."""
    probs = [[0.5, 0.5], [0.25, 0.75]]
    nodes, num, emitted = _one_row([-1, 0], [0, 1], probs, [0.0, 0.5], [1.0, 1.0], 1)
    assert num.item() == 1 and emitted[0].tolist() == [1, 1]
    nodes, num, emitted = _one_row([-1, 0], [0, 1], probs, [0.0, 0.5 + 2**-24], [1.0, 1.0], 1)
    assert num.item() == 0 and emitted[0].tolist() == [0, -1]


def test_bonus_ties_take_the_first_index():
    V = 40
    nodes, num, emitted = _one_row([-1], [3], [[1.0 / V] * V], [0.0], [1.0] * V, 2)
    assert emitted[0].tolist() == [0, -1, -1]


def test_wide_vocabulary_spans_several_blocks():
    """V larger than one BLOCK_V: the blockwise mass sums and argmax carry across blocks."""
    g = torch.Generator().manual_seed(0)
    B, N, V = 3, 9, 5000
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 4]] * B, device=DEVICE)
    tokens = torch.randint(0, V, (B, N), generator=g).to(DEVICE)
    probs = torch.softmax(torch.randn(B, N, V, generator=g) * 4, -1)
    probs[:, :, tokens[0, 1:].cpu()] += 0.2  # likely children: some acceptances
    probs = (probs / probs.sum(-1, keepdim=True)).to(DEVICE)
    u = torch.rand(B, N, generator=g).to(DEVICE)
    xi = torch.empty(B, V).exponential_(generator=g).to(DEVICE)
    _check(tokens, parents, probs, u, xi, 3)


def test_verify_sampling_rejects_bad_arguments():
    B, N, V = 2, 5, 7
    t = torch.zeros(B, N, dtype=torch.int64, device=DEVICE)
    p = torch.full((B, N, V), 1.0 / V, device=DEVICE)
    u = torch.zeros(B, N, device=DEVICE)
    xi = torch.ones(B, V, device=DEVICE)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        verify_sampling(t.int(), t, p, u, xi, 3)
    with pytest.raises(ValueError, match="parents must have shape"):
        verify_sampling(t, t[:, :4], p, u, xi, 3)
    with pytest.raises(TypeError, match="probs must have dtype"):
        verify_sampling(t, t, p.half(), u, xi, 3)
    with pytest.raises(ValueError, match="probs must have shape"):
        verify_sampling(t, t, p[:, :4].contiguous(), u, xi, 3)
    with pytest.raises(ValueError, match="uniforms must be contiguous"):
        verify_sampling(t, t, p, torch.zeros(N, B, device=DEVICE).t(), xi, 3)
    with pytest.raises(ValueError, match="exp_noise must have shape"):
        verify_sampling(t, t, p, u, xi[:, :3], 3)
    with pytest.raises(ValueError, match="max_depth"):
        verify_sampling(t, t, p, u, xi, -1)
