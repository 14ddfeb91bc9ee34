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

The measured pieces, ``AcceptanceProfile`` and ``CostModel``, live in ``runtime/shape_model.py`` (the
runtime reads them back from a profile to re-choose a request's shape, ``runtime/adaptive.py``).

Pure arithmetic on measured figures: nothing here loads or runs a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.config import SpecConfig
from ..runtime.shape_model import AcceptanceProfile, CostModel

TOP_KS = (1, 2, 4, 8)


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
