"""Greedy tree verification kernel vs its reference: bit for bit on every drawn tree.

Trees include the degenerate shapes: root only, one chain at the maximum depth (fully
accepted), all nodes siblings of the root, duplicate tokens among siblings (the lowest node id
must win), padding nodes (parent -1) and padding rows (root only, everything else padding).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.verify import verify_greedy, verify_greedy_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ["random", "chain", "siblings", "root_only", "padding_row", "bushy"]


def make_row(shape: str, n: int, vocab: int, g: torch.Generator) -> tuple[list[int], list[int], list[int]]:
    """One row ``(tokens, parents, target_argmax)`` of ``n`` nodes (node 0 = root)."""
    rnd = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
    parents = [-1] * n
    for i in range(1, n):
        if shape == "chain":
            parents[i] = i - 1
        elif shape == "siblings":
            parents[i] = 0
        elif shape in ("root_only", "padding_row"):
            parents[i] = -1
        elif shape == "bushy":
            parents[i] = rnd(min(i, 3))
        else:
            parents[i] = -1 if rnd(5) == 0 else rnd(i)
    tokens = [rnd(vocab) for _ in range(n)]
    argmax = []
    for i in range(n):
        kids = [c for c in range(1, n) if parents[c] == i]
        if kids and rnd(4) != 0:  # mostly follow a child: long accepted paths
            argmax.append(tokens[kids[rnd(len(kids))]])
        else:
            argmax.append(rnd(vocab + 1))
    return tokens, parents, argmax


@st.composite
def verify_case(draw):
    batch = draw(st.integers(1, 5))
    n = draw(st.integers(1, 24))
    max_depth = draw(st.integers(0, 9))
    vocab = draw(st.sampled_from([1, 2, 3, 50]))  # tiny vocabularies: duplicate sibling tokens
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=batch, max_size=batch))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    rows = [make_row(s, n, vocab, g) for s in shapes]
    t = lambda k: torch.tensor([r[k] for r in rows], dtype=torch.int64, device=DEVICE)  # noqa: E731
    return t(0), t(1), t(2), max_depth


def _check(tokens, parents, argmax, max_depth):
    got = verify_greedy(tokens, parents, argmax, max_depth)
    want = verify_greedy_reference(tokens, parents, argmax, max_depth)
    for name, a, b in zip(("nodes", "num_accepted", "emitted"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    return got


@settings(max_examples=40, deadline=None)
@given(verify_case())
def test_verify_greedy_matches_reference(case):
    _check(*case)


@pytest.mark.parametrize("max_depth", [1, 6, 15])
def test_full_chain_at_max_depth_is_accepted(max_depth):
    n = max_depth + 1
    tokens = torch.arange(10, 10 + n, device=DEVICE)[None]
    parents = torch.arange(-1, n - 1, device=DEVICE)[None]
    argmax = torch.cat([tokens[:, 1:], torch.tensor([[99]], device=DEVICE)], 1)
    nodes, num, emitted = _check(tokens, parents, argmax, max_depth)
    assert num.item() == max_depth and emitted[0, -1].item() == 99


def test_duplicate_sibling_tokens_take_lowest_node():
    tokens = torch.tensor([[0, 7, 7, 7]], device=DEVICE)
    parents = torch.tensor([[-1, 0, 0, 0]], device=DEVICE)
    argmax = torch.tensor([[7, 1, 2, 3]], device=DEVICE)
    nodes, num, emitted = _check(tokens, parents, argmax, 3)
    assert nodes[0, :2].tolist() == [0, 1] and emitted[0, :2].tolist() == [7, 1]


def test_verify_rejects_bad_arguments():
    t = torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        verify_greedy(t.int(), t, t, 3)
    with pytest.raises(ValueError, match="parents must have shape"):
        verify_greedy(t, t[:, :4], t, 3)
    with pytest.raises(ValueError, match="target_argmax must be contiguous"):
        verify_greedy(t, t, torch.zeros(5, 2, dtype=torch.int64, device=DEVICE).t(), 3)
    with pytest.raises(ValueError, match="max_depth"):
        verify_greedy(t, t, t, -1)
