"""The tree-shape model: predicted tokens/s of ``(num_speculative_tokens, top_k, num_draft_tokens)``.

The model (all times measured on the device and backend, batch size 1; ``tree_measure.py``)::

    tokens/round (D, K, N) = 1 + sum of P(v) over the N-1 candidates with the best scores S(v)
                             among those EAGLE-2 expansion drafts at depth D, branching K
    P(v)                   = prod over the path root -> v of p(depth, sibling rank)
    S(v)                   = sum over the path of the drafter's mean log q(depth, sibling rank)
    time/round (D, K, N)   = draft(D, K) + verify(N) + commit(D) + other
        draft(D, K)        = head(K) + (D - 1) * step(K)      one drafter step per level at width K
        verify(N)          = target forward over N tree tokens + greedy verification (interpolated)
        commit(D)          = KV compaction + drafter catch-up over D + 1 tokens (linear in D)
        other              = host bookkeeping per round (read off plain decoding: its round time
                             minus its measured pieces)
    predicted tokens/s     = tokens/round / time/round
    predicted speedup      = predicted tokens/s * time per plain-decoding token

``p(d, r)`` is the drafter's acceptance profile: the probability that, along the target's own
greedy continuation, the target's next token at depth d is the drafter's rank-r candidate,
given that depths 1..d-1 were reachable (measured by teacher forcing, ``tree_measure.py``).
The candidate tree mirrors the runtime's EAGLE-2 expansion (``runtime/tree.py``: top-K children
per frontier node, the best K of each level expand, global rerank by score), scored the way the
runtime scores it: by the drafter's cumulative log-probability, here its mean per (depth, rank)
measured in the same teacher-forced pass (a drafter that is under-confident deep along the right
path gets its deep nodes dropped for shallow siblings, as it does at run time). Assumptions:
ranks at successive depths are independent, and one static tree stands for the per-round
dynamic trees (which adapt to each context, so wide trees measure a little better than predicted).

Pure arithmetic on measured figures: nothing here loads or runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..runtime.config import SpecConfig

TOP_KS = (1, 2, 4, 8)


# ================================================================== acceptance profile
@dataclass
class AcceptanceProfile:
    """``p[d-1][r]``: P(target's next token at depth d is the drafter's rank-r candidate | depth d reachable).

    ``score[d-1][r]`` (optional): the drafter's mean log-probability of its rank-r candidate at
    depth d. EAGLE-2 expands and reranks by the drafter's cumulative log-probability, not by the
    true acceptance; with scores the modelled tree is chosen the way the runtime chooses it (by
    typical confidence) while its value is still counted in acceptance. Without, P orders the tree.
    """

    p: list[list[float]]
    samples: list[int] = field(default_factory=list)  # roots behind each depth's estimate
    score: list[list[float]] | None = None

    @property
    def max_depth(self) -> int:
        return len(self.p)

    @property
    def max_rank(self) -> int:
        return len(self.p[0]) if self.p else 0

    @classmethod
    def from_ranks(cls, ranks: torch.Tensor, max_rank: int, logq: torch.Tensor | None = None) -> AcceptanceProfile:
        """``ranks [S, D]``: the true token's rank at each depth (-1: beyond max_rank or not in the
        draft vocabulary, -2: unknown, the continuation ended); ``logq [S, D, max_rank]``: the
        drafter's top log-probabilities at each depth."""
        S, D = ranks.shape
        p, n, score = [], [], []
        reach = torch.ones(S, dtype=torch.bool)
        for d in range(D):
            known = reach & (ranks[:, d] != -2)
            cnt = int(known.sum())
            row, srow = [0.0] * max_rank, [0.0] * max_rank
            if cnt:
                r = ranks[known, d]
                for k in range(max_rank):
                    row[k] = float((r == k).sum()) / cnt
                if logq is not None:
                    srow = logq[known, d].double().mean(0).tolist()
            p.append(row)
            score.append(srow)
            n.append(cnt)
            reach = reach & (ranks[:, d] >= 0)
        return cls(p, n, score if logq is not None else None)

    def _candidates(self, depth: int, top_k: int) -> list[tuple[float, float]]:
        """``(P, S)`` of every candidate EAGLE-2 drafts at (depth, top_k), in level order:
        P = path acceptance probability, S = cumulative score that orders frontier and rerank."""
        if depth > self.max_depth or top_k > self.max_rank:
            raise ValueError(f"(depth={depth}, top_k={top_k}) exceeds the profile ({self.max_depth}, {self.max_rank})")

        def node(d: int, r: int, parent: tuple[float, float] = (1.0, 0.0)) -> tuple[float, float]:
            s = self.score[d][r] if self.score is not None else math.log(max(self.p[d][r], 1e-30))
            return parent[0] * self.p[d][r], parent[1] + s

        level = [node(0, r) for r in range(top_k)]
        out = list(level)
        for d in range(1, depth):
            frontier = sorted(level, key=lambda c: -c[1])[:top_k]  # the best K of the level expand
            level = [node(d, r, f) for f in frontier for r in range(top_k)]
            out += level
        return out

    def candidate_probs(self, depth: int, top_k: int) -> list[float]:
        """Path probabilities of every candidate EAGLE-2 drafts at (depth, top_k), in level order."""
        return [c[0] for c in self._candidates(depth, top_k)]

    def tokens_per_round(self, depth: int, top_k: int) -> list[float]:
        """``t[n]`` = expected tokens per round with ``num_draft_tokens = n + 1`` (index 0: N=1, plain)."""
        kept = sorted(self._candidates(depth, top_k), key=lambda c: -c[1])  # rerank: the best N-1 scores
        t = [1.0]
        for q, _ in kept:
            t.append(t[-1] + q)
        return t


# ================================================================== cost model
@dataclass
class CostModel:
    """Seconds per round piece on this device/backend (see the module docstring)."""

    verify_n: list[int]
    verify_s: list[float]
    draft_head_s: dict[int, float]  # top_k -> draft time at depth 1
    draft_step_s: dict[int, float]  # top_k -> one more drafter level at width top_k
    commit_s: tuple[float, float]  # (a, b): commit(D) = a + b * D
    plain_s: float  # one plain-decoding token (target forward on the root + commit)
    overhead_s: float = 0.0  # per-round host work outside the three steps (bookkeeping, the one sync)

    def verify(self, n: int) -> float:
        xs, ys = self.verify_n, self.verify_s
        if n <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if n <= xs[i]:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (n - xs[-1])

    def draft(self, depth: int, top_k: int) -> float:
        return self.draft_head_s[top_k] + (depth - 1) * self.draft_step_s[top_k]

    def commit(self, depth: int) -> float:
        return self.commit_s[0] + self.commit_s[1] * depth

    def round(self, depth: int, top_k: int, n: int) -> float:
        return self.draft(depth, top_k) + self.verify(n) + self.commit(depth) + self.overhead_s

    @property
    def plain_token_s(self) -> float:
        return self.plain_s + self.overhead_s


def _monotone(ys: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): verify(N) cannot fall with N,
    whatever timing noise says."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]]
    return [m for m, c in blocks for _ in range(c)]


# ================================================================== the search
@dataclass(frozen=True)
class Prediction:
    spec: SpecConfig
    tokens_per_round: float
    round_s: float
    speedup: float  # predicted tokens/s over plain decoding

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_round / self.round_s


def predict(spec: SpecConfig, costs: CostModel, acc: AcceptanceProfile) -> Prediction:
    D, K, N = spec.num_speculative_tokens, spec.top_k, spec.num_draft_tokens
    tau = acc.tokens_per_round(D, K)[N - 1]
    t = costs.round(D, K, N)
    return Prediction(spec, tau, t, tau / t * costs.plain_token_s)


def search(
    costs: CostModel,
    acc: AcceptanceProfile,
    *,
    max_depth: int | None = None,
    top_ks: Sequence[int] = TOP_KS,
    max_draft_tokens: int = 64,
) -> list[Prediction]:
    """Every valid shape, best predicted tokens/s first (ties: fewer tree tokens, shallower, narrower)."""
    max_depth = min(max_depth or acc.max_depth, acc.max_depth)
    out = []
    for K in sorted(k for k in set(top_ks) if k <= acc.max_rank and k in costs.draft_step_s):
        for D in range(1, max_depth + 1):
            tau = acc.tokens_per_round(D, K)
            n_hi = min(len(tau), max_draft_tokens)  # tau[n-1] is defined for n <= candidates + 1
            for N in range(D + 1, n_hi + 1):  # N - 1 >= D: a tree too small to reach depth D wastes draft steps
                t = costs.round(D, K, N)
                out.append(Prediction(SpecConfig(D, K, N), tau[N - 1], t, tau[N - 1] / t * costs.plain_token_s))
    out.sort(
        key=lambda p: (
            -round(p.tokens_per_second, 9),
            p.spec.num_draft_tokens,
            p.spec.num_speculative_tokens,
            p.spec.top_k,
        )
    )
    return out


def neighbours(best: SpecConfig, ranked: list[Prediction]) -> list[Prediction]:
    """Two shapes next to ``best``, the first that exist of: one level shallower, one deeper
    (same top_k, the best N for each), then the best shape at the next smaller / larger top_k."""
    D, K = best.num_speculative_tokens, best.top_k
    ks = sorted({p.spec.top_k for p in ranked})
    i = ks.index(K)
    wants = [(D - 1, K), (D + 1, K)] + [(D, k) for k in ks[max(i - 1, 0) : i] + ks[i + 1 : i + 2]]
    out = []
    for d, k in wants:
        cands = [p for p in ranked if p.spec.top_k == k and p.spec.num_speculative_tokens == d]
        if cands and len(out) < 2:
            out.append(cands[0])  # ranked: the best N there
    return out
