"""The tree-shape model's measured pieces: a drafter's acceptance profile and a device's round costs.

``AcceptanceProfile`` (what a drafter accepts, per depth and sibling rank) and ``CostModel`` (what a
round's pieces cost on a device) are measured by ``tritonspec autotune tree`` (``autotune/tree_measure.py``)
and stored in a tuned profile (``runtime/profiles.py``). The tuner searches shapes with them
(``autotune/tree_model.py`` states the model); the runtime reads them back to re-choose a request's
shape from the acceptance it observes (``runtime/adaptive.py``).

Pure arithmetic on measured figures: nothing here loads or runs a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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
    """Seconds per round piece on this device/backend (the pieces: ``autotune/tree_model.py``'s module docstring)."""

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
