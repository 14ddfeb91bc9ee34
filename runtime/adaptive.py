"""Adaptive shapes: a request's draft tree re-chosen from the acceptance it shows.

A tuned profile picks one shape per batch size and mode, the best on *average* over its tuning
prompts. Acceptance varies a lot between requests, though: on SmolLM2's chat set (8 prompts,
EAGLE-3.1, 2026-12-06) τ under the HumanEval-tuned (5, 2, 12) + lookup 4 ranged 1.70-3.25 per
prompt; the set ran 1.40x over plain decoding with it and 1.49x with (3, 2, 7) + lookup 4 for
every prompt, while the prompts with τ near 3 ran far faster with the big tree. A big tree pays
where the drafter is accepted deep, a small one where it is not.

So a request that starts on a profile's shape re-chooses it between rounds, with the tuner's own
model (``autotune/tree_model.py``) and the profile's measured pieces (``runtime/shape_model.py``):

    p_λ(d, r)   = λ p(d, r) (capped so a level's siblings sum to <= 1): the profile's acceptance,
                  scaled by one factor λ that says how well this request accepts the drafter
    τ(s, λ)     = expected tokens per round of shape s under p_λ (the tuner's EAGLE-2 tree model)
    cost(s)     = draft + verify(N + lookup) + commit + other, in seconds (the profile's costs)
    λ̂           = the λ at which the rounds run so far, weighted by decay ** age, would have been
                  predicted: sum w_i (τ(s_i, λ̂) - a_i) = 0 (a_i = tokens round i emitted, s_i its shape)
    next shape  = argmax over the candidates of τ(s, λ̂) / cost(s), once ``min_rounds`` rounds are
                  seen, and only when it beats the current shape by ``margin`` (no flapping)

The candidates are the shapes the tuner measured for that row (its ``decode_tokens_per_s``
table), each with the row's prompt-lookup settings. A lookup branch's matches count in a_i and
so in λ̂ (the model has no term for them; every candidate carries the same branch).

Where it runs: a batch-1 greedy request whose shape came from a tuned profile with measured
``costs`` and ``acceptance`` (the profile's short-context row: long-context rows and larger
batches keep their measured shape), on eager rounds (a compiled or CUDA-graph round is one
artifact per shape), with no drift observer. Greedy output is the target's whatever the shape, so
switching never changes tokens. ``SpeculativeRuntime(adaptive_shape=False)`` or the CLI's
``--no-adaptive-shape`` turns it off; ``SpecStats.shape_switches`` and ``rounds_per_shape`` say
what it did.

Pure arithmetic on host integers: one call per round, a few microseconds, no device reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import SpecConfig
from .shape_model import AcceptanceProfile, CostModel

LAMBDAS = tuple(round(0.2 + 0.05 * i, 2) for i in range(37))  # 0.2 .. 2.0: the grid λ̂ is read on
DECAY = 0.85  # weight of a round one round older (about the last 7 rounds count)
MIN_ROUNDS = 3  # rounds seen before the first switch
MARGIN = 0.03  # a switch must predict at least 3% more tokens/s than staying


def scaled(acc: AcceptanceProfile, lam: float) -> AcceptanceProfile:
    """``acc`` with every acceptance probability times ``lam``, capped in rank order so that a level's
    ranks stay exclusive events: ``p'(d, r) = min(lam p(d, r), 1 - sum_{r' < r} p'(d, r'))``, i.e. the
    chance that one of the first r ranks is accepted is ``min(lam P(d, <= r), 1)``, which grows with
    ``lam`` (the drafter's scores, which order the tree, are unchanged)."""
    p = []
    for row in acc.p:
        out, total = [], 0.0
        for x in row:
            v = min(x * lam, 1.0 - total)
            out.append(v)
            total += v
        p.append(out)
    return AcceptanceProfile(p, list(acc.samples), acc.score)


@dataclass(frozen=True)
class ShapeLadder:
    """The candidate shapes of one profile row and their model tables over the λ grid.

    ``tau[i][j]``: predicted tokens per round of ``shapes[i]`` at ``LAMBDAS[j]``; ``round_s[i]``:
    its predicted round time; ``best[j]``: the index of the fastest shape at ``LAMBDAS[j]``."""

    shapes: tuple[SpecConfig, ...]
    tau: tuple[tuple[float, ...], ...]
    round_s: tuple[float, ...]
    best: tuple[int, ...]

    @classmethod
    def build(cls, shapes: Sequence[SpecConfig], acc: AcceptanceProfile, costs: CostModel) -> ShapeLadder | None:
        """The ladder of ``shapes`` the model can predict (depth and top-k within the profile's
        measured ones, at least the root plus one node); None when fewer than two remain."""
        ok = []
        for s in shapes:
            D, K, N = s.num_speculative_tokens, s.top_k, s.num_draft_tokens
            fits = D <= acc.max_depth and K <= acc.max_rank and K in costs.draft_head_s and K in costs.draft_step_s
            if fits and N >= 2 and s not in ok and N <= len(acc.tokens_per_round(D, K)):
                ok.append(s)
        if len(ok) < 2:
            return None
        tables = [scaled(acc, lam) for lam in LAMBDAS]
        tau = tuple(
            tuple(t.tokens_per_round(s.num_speculative_tokens, s.top_k)[s.num_draft_tokens - 1] for t in tables)
            for s in ok
        )
        round_s = tuple(
            costs.round(s.num_speculative_tokens, s.top_k, s.verify_tokens) for s in ok
        )  # the lookup branch's rows are verified too
        best = tuple(max(range(len(ok)), key=lambda i: tau[i][j] / round_s[i]) for j in range(len(LAMBDAS)))
        return cls(tuple(ok), tau, round_s, best)

    def track(self, start: SpecConfig) -> ShapeTracker:
        """A per-request tracker that starts on ``start`` (which must be one of ``shapes``)."""
        return ShapeTracker(self, self.shapes.index(start))


class ShapeTracker:
    """One request's running estimate of λ and the shape it should run (module docstring)."""

    def __init__(self, ladder: ShapeLadder, current: int):
        self.ladder = ladder
        self.current = current
        self.residual = [0.0] * len(LAMBDAS)  # sum_i w_i (tau(s_i, λ_j) - a_i), for every grid λ_j
        self.rounds = 0

    @property
    def spec(self) -> SpecConfig:
        return self.ladder.shapes[self.current]

    def estimate(self) -> int:
        """Index into ``LAMBDAS`` of λ̂: the first grid point whose weighted residual is >= 0
        (the residual grows with λ; the largest when the rounds beat every prediction)."""
        for j, r in enumerate(self.residual):
            if r >= 0.0:
                return j
        return len(LAMBDAS) - 1

    def observe(self, tokens: Sequence[int]) -> SpecConfig | None:
        """Feed one round: ``tokens``, the tokens each live row emitted (accepted + 1). Returns the
        shape to run next when it changes, else None."""
        if not tokens:
            return None
        a = sum(tokens) / len(tokens)
        row = self.ladder.tau[self.current]
        self.residual = [DECAY * r + (t - a) for r, t in zip(self.residual, row)]
        self.rounds += 1
        if self.rounds < MIN_ROUNDS:
            return None
        j = self.estimate()
        lad = self.ladder
        b = lad.best[j]
        if b == self.current:
            return None
        rate = lambda i: lad.tau[i][j] / lad.round_s[i]  # noqa: E731
        if rate(b) < rate(self.current) * (1.0 + MARGIN):
            return None
        self.current = b
        return lad.shapes[b]
