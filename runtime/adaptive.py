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
    cost(s)     = τ(s, 1) / (the decode tokens/s the tuner measured for s): the measured round
                  time, so that at λ = 1 the ladder ranks shapes as the tuner's measurements did
                  (the model's own draft + verify + commit + other where a shape was not measured)
    λ̂           = the λ at which the rounds run so far, weighted by decay ** age, would have been
                  predicted: sum w_i (τ(s_i, λ̂) - a_i) = 0 (a_i = 1 + the drafter nodes round i
                  accepted, s_i its shape)
    next shape  = argmax over the candidates of τ(s, λ̂) / cost(s), once ``min_rounds`` rounds are
                  seen, and only when it beats the current shape by ``margin`` (no flapping)

The candidates are the shapes the tuner measured for that row (its ``decode_tokens_per_s``
table) at >= ``profiles.LADDER_MIN_RATE`` of the row's best and faster than plain decoding, each
with the row's prompt-lookup settings. The model has no term for the lookup branch (every
candidate carries the same one), so a_i counts the drafter's tree only (``Decoder.commit``
records it when ``track_drafted`` is set), and a round whose accepted path ran on along the
lookup branch past the tree is left out (what the tree alone would have accepted is unknown).

Where it runs: a greedy row running alone (a batch-1 request, or the last row of a batch) whose
shape came from a tuned profile's batch-1 greedy row with measured ``costs`` and ``acceptance``
(the short-context row, and since 2026-12-07 each long-context row with its own measured rates,
where a request switches only after ``LONG_MIN_ROUNDS`` rounds: demo pair, EAGLE-3.1, one thread,
8 prompts x 64 tokens, 3 passes, its (8,1,9) long row moving to (2,1,3) on the two poorly accepted
775-786-token prompts: standard 1.400x → 1.436x, perturbed 1.386x → 1.432x, long 1.183x → 1.183x
over plain decoding; larger batches keep their measured shape; a row whose ladder would not keep
its pick at λ = 1 has none), on eager rounds
(a compiled or CUDA-graph round is one artifact per shape), with no drift observer. Greedy output is
the target's whatever the shape, so switching never changes tokens.

By the rows (``SpeculativeRuntime._by_width``, the same conditions but any number of rows): a greedy
request also re-chooses its shape from the policy whenever the rows a round runs change (a static
batch narrowing as its rows stop, a continuous batch refilled or draining, a long prompt joining or
leaving): the profile's row for that many rows and that context. A batch-4 chain verified on the one
row left is much shorter than that row's batch-1 shape. Demo pair, Intel Xeon, one thread, 8 standard
prompts at batch 4 (2026-12-06): EAGLE-3.1 1.15x → 1.17x over plain decoding, EAGLE-3 1.24x → 1.23x,
tokens unchanged.

``SpeculativeRuntime(adaptive_shape=False)`` or the CLI's ``--no-adaptive-shape`` turns both off;
``SpecStats.shape_switches`` (changes while a row ran on: a new request's first shape is none) and
``rounds_per_shape`` say what they did.

Per round: a few host integer operations here, and in ``commit`` four tiny tensor ops whose
result the round's one sync (``collect``) reads with the emitted tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .config import SpecConfig
from .shape_model import AcceptanceProfile, CostModel

LAMBDAS = tuple(round(0.2 + 0.05 * i, 2) for i in range(37))  # 0.2 .. 2.0: the grid λ̂ is read on
DECAY = 0.85  # weight of a round one round older (about the last 7 rounds count)
MIN_ROUNDS = 3  # rounds seen before the first switch
# on a long-context row: its ladder models acceptance with the short prompts' profile, whose fall with depth
# long prompts do not share (their loops are accepted deep once entered), so early rounds mislead it more.
# Demo EAGLE-3.1, 8 prompts x 64 tokens, 3 passes, over plain decoding with no long-row ladder -> 3 / 6 / 8
# rounds: long set 1.216x -> 1.179 / 1.175 / 1.211x (2 threads), standard 1.569x -> 1.640 / 1.634 / 1.625x
LONG_MIN_ROUNDS = 8
MARGIN = 0.03  # a switch must predict at least 3% more tokens/s than staying


def scaled(acc: AcceptanceProfile, lam: float) -> AcceptanceProfile:
    """``acc`` with every acceptance probability times ``lam``, capped in rank order so that a level's
    ranks stay exclusive events: ``p'(d, r) = min(lam p(d, r), 1 - sum_{r' < r} p'(d, r'))``, i.e. the
    chance that one of the first r ranks is accepted is ``min(lam P(d, <= r), 1)``, which grows with
    ``lam``. The drafter's scores, which order the tree, are kept (a profile without scores orders
    it by the scaled p)."""
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

    ``tau[i][j]``: predicted tokens per round of ``shapes[i]`` (its drafter tree, root included) at
    ``LAMBDAS[j]``; ``round_s[i]``: its round time in seconds (calibrated by the tuner's measured rate,
    ``build``); ``best[j]``: the index of the fastest shape at ``LAMBDAS[j]``."""

    shapes: tuple[SpecConfig, ...]
    tau: tuple[tuple[float, ...], ...]
    round_s: tuple[float, ...]
    best: tuple[int, ...]
    min_rounds: int = MIN_ROUNDS  # rounds a request runs before its first switch

    @classmethod
    def build(
        cls,
        shapes: Sequence[SpecConfig],
        acc: AcceptanceProfile,
        costs: CostModel,
        measured: Sequence[float | None] | None = None,
    ) -> ShapeLadder | None:
        """The ladder of ``shapes`` the model can predict (depth and top-k within the profile's
        measured ones, at least the root plus one node); None when fewer than two remain.

        ``measured[i]``: decode tokens/s the tuner measured for ``shapes[i]`` without its lookup
        branch, on the prompts ``acc`` was measured on (None: not measured). It calibrates the
        shape's round time to ``τ(s, 1) / measured`` (the model's τ at the profile's own acceptance
        over the measured rate), so that at λ = 1 the ladder ranks shapes as the measurements did:
        the model alone misjudges some shapes' cost (on the demo pair's EAGLE-3 avx512 profile it
        put (8,1,9) 16 % ahead of the tuned (3,1,4), measured 14 % behind). The lookup branch,
        the same on every candidate, is left out of both sides: its rows are verified only when
        it matched (eager CPU rounds cut the padding), and its tokens are not in a_i."""
        measured = list(measured) if measured is not None else [None] * len(shapes)
        if len(measured) != len(shapes):
            raise ValueError(f"{len(measured)} measured rates for {len(shapes)} shapes")
        ok, round_s = [], []
        for s, m in zip(shapes, measured):
            D, K, N = s.num_speculative_tokens, s.top_k, s.num_draft_tokens
            fits = D <= acc.max_depth and K <= acc.max_rank and K in costs.draft_head_s and K in costs.draft_step_s
            tau1 = acc.tokens_per_round(D, K) if fits else []  # at λ = 1, by num_draft_tokens - 1
            if fits and N >= 2 and s not in ok and N <= len(tau1):
                ok.append(s)
                round_s.append(tau1[N - 1] / m if m is not None and m > 0 else costs.round(D, K, N))
        if len(ok) < 2:
            return None
        tables = [scaled(acc, lam) for lam in LAMBDAS]
        tau = tuple(
            tuple(t.tokens_per_round(s.num_speculative_tokens, s.top_k)[s.num_draft_tokens - 1] for t in tables)
            for s in ok
        )
        if not all(r > 0 and math.isfinite(r) for r in round_s):
            raise ValueError(f"round times must be positive, got {round_s}")
        best = tuple(max(range(len(ok)), key=lambda i: tau[i][j] / round_s[i]) for j in range(len(LAMBDAS)))
        return cls(tuple(ok), tau, tuple(round_s), best)

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
        """Feed one round: ``tokens``, per live row 1 + the drafter nodes it accepted (empty: the round
        says nothing, e.g. the lookup branch went further). Returns the shape to run next when it
        changes, else None."""
        if not tokens:
            return None
        a = sum(tokens) / len(tokens)
        row = self.ladder.tau[self.current]
        self.residual = [DECAY * r + (t - a) for r, t in zip(self.residual, row)]
        self.rounds += 1
        if self.rounds < self.ladder.min_rounds:
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
