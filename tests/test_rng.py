"""The counter-based per-request random numbers (runtime/sampling.py ``RowRandom``).

Exact integer arithmetic (the split multiply never overflows int64), a row's draws depend only on
its seed and round, and the outputs look uniform / exponential and uncorrelated across
neighbouring seeds, rounds and indices; an inverse test shows the statistics catch a weak hash.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonspec.runtime.sampling import RowRandom, _mul32, mix32

CPU = torch.device("cpu")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_mul32_is_exact_modular_multiplication(xs, c):
    got = _mul32(torch.tensor(xs, dtype=torch.int64), c).tolist()
    assert got == [(x * c) % 2**32 for x in xs]


def test_mix32_is_a_bijection_on_a_block():
    x = torch.arange(2**20, dtype=torch.int64) * 4099 % 2**32
    h = mix32(x)
    assert h.unique().numel() == x.numel() and int(h.min()) >= 0 and int(h.max()) < 2**32


def test_rows_depend_only_on_seed_and_round():
    batch = RowRandom([7, 2**63 + 5, -3, 0], CPU)
    solo = RowRandom([-3], CPU)
    for _ in range(3):
        u, e = batch.draw(9, 50)
        us, es = solo.draw(9, 50)
        assert torch.equal(u[2], us[0]) and torch.equal(e[2], es[0])
    assert batch.counter.tolist() == [3, 3, 3, 3]
    again = RowRandom([7], CPU)
    first, _ = again.draw(9, 50)
    assert not torch.equal(first[0], u[0])  # round 3 differs from round 1 of the same seed
    assert u.dtype == torch.float32 and float(u.max()) < 1.0 and float(u.min()) >= 0.0
    assert float(e.min()) > 0.0


def _uniform_chi2(u: torch.Tensor, bins: int = 64) -> float:
    counts = torch.histc(u.double(), bins=bins, min=0.0, max=1.0)
    expect = u.numel() / bins
    return float(((counts - expect) ** 2 / expect).sum())


def _stats(draws: torch.Tensor) -> tuple[float, float]:
    """(chi-square over 64 bins, |correlation| of neighbours along the last axis)."""
    x = draws.double()
    a, b = x[..., :-1].flatten(), x[..., 1:].flatten()
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return _uniform_chi2(draws.flatten()), abs(corr)


CHI2_64_CRIT = 120.0  # chi-square, 63 degrees of freedom: P(X > 120) ~ 1e-5
CORR_CRIT = 0.01  # with >= 2e5 pairs the sd of a null correlation is ~2e-3


def test_uniforms_and_noise_look_random():
    seeds = list(range(1000, 1256))  # neighbouring seeds, as generate(seed=[...]) users pass them
    rng = RowRandom(seeds, CPU)
    us, es = [], []
    for _ in range(4):
        u, e = rng.draw(200, 1000)
        us.append(u)
        es.append(e)
    u, e = torch.stack(us, 1), torch.stack(es, 1)  # [seeds, rounds, n]
    chi2, corr = _stats(u)
    assert chi2 < CHI2_64_CRIT and corr < CORR_CRIT
    across_seeds = u[:, 0, 0]  # first coin of each neighbouring seed
    assert _uniform_chi2(u.transpose(0, 2).flatten(), 16) < 60  # seed-major order as well
    assert abs(float(torch.corrcoef(torch.stack([across_seeds[:-1], across_seeds[1:]]).double())[0, 1])) < 0.2
    assert abs(float(e.double().mean()) - 1.0) < 0.01 and abs(float(e.double().var()) - 1.0) < 0.03
    p = torch.exp(-e.double())  # Exp(1) -> U(0, 1)
    chi2, corr = _stats(p)
    assert chi2 < CHI2_64_CRIT and corr < CORR_CRIT


def test_statistics_catch_a_weak_hash():
    """Inverse: uniforms from a plain affine counter (no mixing) fail the same checks."""
    idx = torch.arange(256 * 4 * 200, dtype=torch.int64).view(256, 4, 200)
    weak = ((idx * 2654435761) % 2**32 >> 8).float() * 2.0**-24  # a Weyl sequence: uniform but correlated
    chi2, corr = _stats(weak)
    assert chi2 > CHI2_64_CRIT or corr > CORR_CRIT
    assert math.isfinite(chi2)
