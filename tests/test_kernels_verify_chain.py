"""Sampled-chain verification (kernels/verify_chain.py): the Triton kernel equals the reference bit
for bit (hypothesis, degenerate cases); the op is lossless (chi-square on the first two emitted
tokens and on the bonus after a fully accepted chain, 200k samples); inverse tests show a rule
without the residual and a wrong all-accepted bonus fail the same test."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.verify_chain import verify_chain, verify_chain_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def chain_case(draw):
    return dict(
        B=draw(st.integers(1, 6)),
        n=draw(st.integers(1, 6)),
        V=draw(st.sampled_from([1, 2, 7, 99, 300])),
        seed=draw(st.integers(0, 2**16)),
        same=draw(st.booleans()),
        zero_q=draw(st.booleans()),
        peaked=draw(st.booleans()),
    )


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, n, V = c["B"], c["n"], c["V"]
    scale = 8.0 if c["peaked"] else 1.0
    probs = (torch.randn(B, n + 1, V, generator=g) * scale).softmax(-1)
    q = probs[:, 1:].clone() if c["same"] else (torch.randn(B, n, V, generator=g) * scale).softmax(-1)
    if c["zero_q"] and V > 1:  # tokens the drafter cannot emit (top-k/top-p removed them)
        q[..., : V // 2] = 0
        q = q / q.sum(-1, keepdim=True)
    tokens = torch.randint(0, V, (B, n + 1), generator=g)
    tokens[:, 1:] = torch.where(torch.rand(B, n, generator=g) < 0.7, q.argmax(-1), tokens[:, 1:])
    u = torch.rand(B, n + 1, generator=g)
    xi = torch.empty(B, V).exponential_(generator=g).clamp(min=torch.finfo(torch.float32).tiny)
    return [t.to(DEVICE) for t in (tokens, probs, q, u, xi)]


@settings(max_examples=40, deadline=None)
@given(chain_case())
def test_kernel_equals_reference(c):
    args = _inputs(c)
    want = verify_chain_reference(*args)
    got = verify_chain(*args)
    for name, a, b in zip(("nodes", "num", "emitted"), got, want):
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    nodes, num, emitted = want
    assert ((num >= 0) & (num <= c["n"])).all()
    assert (emitted.gather(1, num[:, None]) >= 0).all()  # always a bonus token


def test_kernel_rejects_bad_input():
    args = _inputs(dict(B=2, n=2, V=7, seed=0, same=False, zero_q=False, peaked=False))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain(args[0], args[1], args[2][:, :1], *args[3:])
    with pytest.raises(ValueError, match="at least one drafted token"):
        verify_chain(
            args[0][:, :1].contiguous(),
            args[1][:, :1].contiguous(),
            args[2][:, :0].contiguous(),
            args[3][:, :1].contiguous(),
            args[4],
        )


V, N_SAMPLES = 5, 200_000


def _sample(rule, seed=0):
    """Draws of a depth-2 chain: x1 ~ q1, x2 ~ q2[x1]; the target's p1 depends on x1 (a table),
    as a real target's would. Returns counts of the first two emitted tokens."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05])
    p1 = torch.rand(V, V, generator=g).softmax(-1)  # p1[x1] = next-token distribution after x1
    q1 = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])
    q2 = torch.rand(V, V, generator=g).pow(3).softmax(-1)
    B = N_SAMPLES
    x1 = torch.multinomial(q1, B, replacement=True, generator=g)
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]
    P2 = torch.rand(V, V, V, generator=g).softmax(-1)  # P2[x1, x2] = the bonus distribution after x1 x2
    p2 = P2[x1, x2]
    tokens = torch.stack([torch.zeros(B, dtype=torch.int64), x1, x2], 1)
    probs = torch.stack([p0.expand(B, V), p1[x1], p2], 1)
    draft = torch.stack([q1.expand(B, V), q2[x1]], 1)
    u = torch.rand(B, 3, generator=g)
    xi = torch.empty(B, V).exponential_(generator=g)
    nodes, num, emitted = rule(tokens, probs, draft, u, xi)
    # the second emitted token: after an accepted x1 it is drawn at depth 2; after a rejection at
    # depth 1 the row emitted one token only, and the target's next token would follow p1[e1]
    e1 = emitted[:, 0]
    joint = torch.zeros(V, V)
    two = num >= 1
    joint.index_put_((e1[two], emitted[two, 1]), torch.ones(int(two.sum())), accumulate=True)
    full = num == 2  # both drafts accepted: the third token is the bonus, ~ P2[x1, x2]
    third = torch.zeros(V, V, V)
    third.index_put_((x1[full], x2[full], emitted[full, 2]), torch.ones(int(full.sum())), accumulate=True)
    return joint, two, e1, p0, p1, third, P2


def _chi2(rule) -> tuple[float, float]:
    joint, two, e1, p0, p1, third, P2 = _sample(rule)
    first = torch.bincount(e1, minlength=V).double()
    stat = float(((first - N_SAMPLES * p0) ** 2 / (N_SAMPLES * p0)).sum())
    df = V - 1
    # second token, given the first and that the chain went on (x1 accepted => e1 = x1, e2 ~ p1[x1])
    for a in range(V):
        n_a = joint[a].sum()
        if n_a < 50:
            continue
        e = n_a * p1[a]
        stat += float(((joint[a] - e) ** 2 / e).sum())
        df += V - 1
        for b in range(V):  # the all-accepted bonus token, given the chain
            n_ab = third[a, b].sum()
            if n_ab >= 50:
                e = n_ab * P2[a, b]
                stat += float(((third[a, b] - e) ** 2 / e).sum())
                df += V - 1
    z = 3.719  # one-sided 1e-4, Wilson-Hilferty
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_op_is_lossless():
    stat, crit = _chi2(verify_chain_reference)
    assert stat < crit, f"chi2={stat:.1f} > {crit:.1f}"


def test_rule_without_residual_fails():  # inverse: the test has teeth
    def no_residual(tokens, probs, draft, u, xi):
        nodes, num, emitted = verify_chain_reference(tokens, probs, draft, u, xi)
        bonus = (probs[torch.arange(len(num)), num] / xi).argmax(-1)  # p instead of max(0, p - q)
        return nodes, num, emitted.scatter(1, num[:, None], bonus[:, None])

    stat, crit = _chi2(no_residual)
    assert stat > crit, f"a biased rule went undetected: chi2={stat:.1f} <= {crit:.1f}"


def test_wrong_bonus_after_a_full_chain_fails():  # inverse: the all-accepted bonus is checked too
    def stale_bonus(tokens, probs, draft, u, xi):
        nodes, num, emitted = verify_chain_reference(tokens, probs, draft, u, xi)
        alt = (probs[torch.arange(len(num)), 1] / xi).argmax(-1)  # p1 instead of p2 after both accepted
        return nodes, num, torch.where((num == 2)[:, None] & (torch.arange(3) == 2), alt[:, None], emitted)

    stat, crit = _chi2(stale_bonus)
    assert stat > crit, f"a wrong bonus went undetected: chi2={stat:.1f} <= {crit:.1f}"
