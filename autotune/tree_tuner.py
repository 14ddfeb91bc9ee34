"""Tree-shape tuner: pick ``(num_speculative_tokens, top_k, num_draft_tokens)`` for this device.

The model (all times measured here, on this device and backend, batch size 1)::

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
given that depths 1..d-1 were reachable. It is measured by teacher forcing: for sample prompts
the target's greedy continuation is generated, then at each root the drafter drafts a chain
along the *true* tokens and the rank of each true token in its draft distribution is recorded.
The candidate tree mirrors the runtime's EAGLE-2 expansion (``runtime/tree.py``: top-K children
per frontier node, the best K of each level expand, global rerank by score), scored the way the
runtime scores it: by the drafter's cumulative log-probability, here its mean per (depth, rank)
measured in the same teacher-forced pass (a drafter that is under-confident deep along the right
path gets its deep nodes dropped for shallow siblings, as it does at run time). Assumptions:
ranks at successive depths are independent, and one static tree stands for the per-round
dynamic trees (which adapt to each context, so wide trees measure a little better than predicted).

Every cost is measured through the runtime's own round steps (``_draft``, ``_verify``,
``_commit``), so what is timed is what runs.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..runtime.bench import device_sync
from ..runtime.config import SpecConfig, SpecStats
from ..runtime import profiles as prof
from . import store

TOP_KS = (1, 2, 4, 8)
VERIFY_NS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


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
    def from_ranks(cls, ranks: torch.Tensor, max_rank: int, logq: torch.Tensor | None = None) -> "AcceptanceProfile":
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


def search(costs: CostModel, acc: AcceptanceProfile, *, max_depth: int | None = None,
           top_ks: Sequence[int] = TOP_KS, max_draft_tokens: int = 64) -> list[Prediction]:
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
    out.sort(key=lambda p: (-round(p.tokens_per_second, 9), p.spec.num_draft_tokens, p.spec.num_speculative_tokens,
                            p.spec.top_k))
    return out


def neighbours(best: SpecConfig, ranked: list[Prediction]) -> list[Prediction]:
    """Two shapes next to ``best``, the first that exist of: one level shallower, one deeper
    (same top_k, the best N for each), then the best shape at the next smaller / larger top_k."""
    D, K = best.num_speculative_tokens, best.top_k
    ks = sorted({p.spec.top_k for p in ranked})
    i = ks.index(K)
    wants = [(D - 1, K), (D + 1, K)] + [(D, k) for k in ks[max(i - 1, 0):i] + ks[i + 1:i + 2]]
    out = []
    for d, k in wants:
        cands = [p for p in ranked if p.spec.top_k == k and p.spec.num_speculative_tokens == d]
        if cands and len(out) < 2:
            out.append(cands[0])  # ranked: the best N there
    return out


# ================================================================== measurements through the runtime
def _stats(depth: int) -> SpecStats:
    return SpecStats(accepted_per_position=[0] * depth)


def _prefill(rt, prompt_ids: list[list[int]]):
    from ..runtime.sampling import SamplingParams

    return rt._prefill(prompt_ids, True, SamplingParams(), [0] * len(prompt_ids), _stats(rt.spec.num_speculative_tokens))


def _heap_tree(root: torch.Tensor, n: int, vocab: int):
    """A synthetic n-node tree (binary heap: node i's parent is (i-1)//2) for timing verify(n)."""
    from ..runtime.engine import _Tree

    dev = root.device
    B = root.shape[0]
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)], device=dev)
    depth = torch.tensor([0] + [int(math.log2(i + 1)) for i in range(1, n)], device=dev)
    mask = torch.zeros(n, n, dtype=torch.bool, device=dev)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = int(parents[j]) if j > 0 else -1
    tokens = torch.cat([root[:, None], torch.arange(1, n, device=dev).remainder(vocab)[None].expand(B, n - 1)], 1)
    return _Tree(tokens, parents[None].expand(B, n).clone(), depth[None].expand(B, n).clone(), mask[None].expand(B, n, n),
                 int(depth.max()))


def measure_costs(rt, prompt_ids: list[int], *, max_depth: int, top_ks: Sequence[int],
                  verify_ns: Sequence[int] = VERIFY_NS, max_n: int = 64, reps: int = 5) -> CostModel:
    """Time the round pieces at batch size 1 on a context of ``len(prompt_ids)`` tokens.

    Round robin: each repetition times every piece once, in turn (a warm-up pass first), so a
    change of machine load spreads over all pieces instead of skewing one, and no piece is timed
    with caches left warm by its own previous call. Means over ``reps``."""
    dev = rt.device
    saved_spec = rt.spec
    with torch.inference_mode():
        st = _prefill(rt, [prompt_ids])
        live = (st.L, st.root, st.hn_last, st.carry_last)  # static buffers, updated in place by commit
        snap = [t.clone() for t in live], list(st.L_host)

        def restore():
            for t, s in zip(live, snap[0]):
                t.copy_(s)
            st.L_host = list(snap[1])

        stats = _stats(max_depth)
        room = rt.target.k_cache.shape[2] - 1 - len(prompt_ids)  # tree slots after the prompt
        ns = sorted({1, 2} | {n for n in verify_ns if n <= min(room, max_n)})
        items = {}  # key -> (spec to set or None, timed call, untimed restore or None)
        for n in ns:
            tree = rt._root_only(st) if n == 1 else _heap_tree(st.root, n, rt.target.vocab_size)
            items["verify", n] = (None, lambda tree=tree: rt._verify(st, tree, stats), None)
        depths = sorted({1, max_depth})
        for K in top_ks:
            for D in depths:
                items["draft", D, K] = (SpecConfig(D, K, min(K + (D - 1) * K * K + 1, 64)),
                                        lambda: rt._draft(st, stats), None)
        for D in depths:
            rt.spec = SpecConfig.chain(D)
            tree = rt._draft(st, stats)
            out = rt._verify(st, tree, stats)
            items["commit", D] = (None, lambda tree=tree, out=out: rt._commit(st, tree, *out, True, stats), restore)
        root = rt._root_only(st)
        vout = rt._verify(st, root, stats)
        items["plain_commit"] = (None, lambda: rt._commit(st, root, *vout, False, stats), restore)
        times: dict = {k: [] for k in items}
        for rep in range(reps + 1):
            for k, (spec, fn, after) in items.items():
                if spec is not None:
                    rt.spec = spec
                device_sync(dev)
                t0 = time.perf_counter()
                fn()
                device_sync(dev)
                if rep:  # pass 0 warms up
                    times[k].append(time.perf_counter() - t0)
                if after is not None:
                    after()
        # means, not medians: generation pays every stall (preemption on a busy CPU, allocator,
        # GC), and the figures predicted here are compared with generation's summed wall time
        med = {k: sum(v) / len(v) for k, v in times.items()}
    rt.spec = saved_spec
    verify_s = [med["verify", n] for n in ns]
    span = max(max_depth - 1, 1)
    head = {K: med["draft", 1, K] for K in top_ks}
    step = {K: max((med["draft", max_depth, K] - med["draft", 1, K]) / span, 0.0) for K in top_ks}
    b = max((med["commit", max_depth] - med["commit", 1]) / span, 0.0)
    return CostModel(ns, _monotone(verify_s), head, step, (med["commit", 1] - b, b), verify_s[0] + med["plain_commit"])


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


def _draft_ids(drafter, vocab: int, device) -> torch.Tensor:
    """target id -> draft id (-1: not in the draft vocabulary)."""
    vd = drafter.config.draft_vocab_size
    t2d = torch.full((vocab,), -1, dtype=torch.int64, device=device)
    ids = torch.arange(vd, device=device)
    t2d[drafter.to_target_ids(ids)] = ids
    return t2d


def _rank(lp: torch.Tensor, draft_id: torch.Tensor, max_rank: int) -> torch.Tensor:
    """Rank of ``draft_id`` in ``lp [B, Vd]`` under the runtime's stable top-k order; -1 if >= max_rank
    or not drafted."""
    v = lp.gather(1, draft_id.clamp(min=0)[:, None])
    idx = torch.arange(lp.shape[1], device=lp.device)[None]
    r = (lp > v).sum(1) + ((lp == v) & (idx < draft_id[:, None])).sum(1)
    return torch.where((draft_id >= 0) & (r < max_rank), r, -1)


def forced_chain_ranks(rt, st, future: torch.Tensor, max_rank: int, t2d: torch.Tensor):
    """Teacher-forced draft from the current state: the drafter drafts a chain along ``future
    [B, D]`` (the true next tokens, -1 = unknown) exactly as ``_draft`` drafts one tree branch;
    returns each true token's rank ``[B, D]`` (-1: beyond max_rank, -2: unknown) and the
    drafter's top log-probabilities ``[B, D, max_rank]``."""
    d = rt.drafter
    B, D = future.shape
    dev = rt.device
    lp = rt._draft_logprobs(st, st.hn_last)  # [B, Vd]
    ranks = [_rank(lp, t2d[future[:, 0].clamp(min=0)], max_rank)]
    tops = [lp.topk(max_rank, dim=-1).values]
    hid = st.carry_last[:, None, :]
    width = max(D - 1, 1)
    fmask = torch.zeros(B, 1, width, dtype=torch.bool, device=dev)
    kv_len = max(st.L_host) + width
    for s in range(1, D):
        fmask[:, :, s - 1] = True
        tok = future[:, s - 1 : s].clamp(min=0)
        positions = (st.L + s - 1)[:, None]
        hn, carry = d.step(rt.ops, hid, tok, positions, rt.dk, rt.dv, (st.L + s - 1)[:, None], st.L, fmask, kv_len)
        lp = rt._draft_logprobs(st, hn)[:, 0]
        ranks.append(_rank(lp, t2d[future[:, s].clamp(min=0)], max_rank))
        tops.append(lp.topk(max_rank, dim=-1).values)
        hid = carry
    r = torch.stack(ranks, 1)
    return torch.where(future >= 0, r, -2), torch.stack(tops, 1).float()


def measure_acceptance(rt, prompts: list[list[int]], continuations: list[list[int]], *, max_depth: int,
                       max_rank: int, stride: int = 1) -> tuple[AcceptanceProfile, int]:
    """Teacher-forced ranks at roots every ``stride + 1`` tokens of each continuation (the target's
    greedy output). Returns the profile and the number of roots sampled."""
    dev = rt.device
    t2d = _draft_ids(rt.drafter, rt.target.vocab_size, dev)
    rows, logqs = [], []
    saved_spec = rt.spec
    rt.spec = SpecConfig.chain(max(stride, 1))
    c = max(stride, 1)
    with torch.inference_mode():
        for prompt, cont in zip(prompts, continuations):
            st = _prefill(rt, [prompt])
            if int(st.root[0]) != cont[0]:
                continue
            y = torch.tensor(cont, device=dev)
            pos = 0
            stats = _stats(c)
            while pos + 1 < len(cont) and max(st.L_host) + c + 1 < rt.max_seq_len:
                fut = torch.full((1, max_depth), -1, dtype=torch.int64, device=dev)
                nxt = y[pos + 1 : pos + 1 + max_depth]
                fut[0, : nxt.numel()] = nxt
                r, lq = forced_chain_ranks(rt, st, fut, max_rank, t2d)
                rows.append(r[0].cpu())
                logqs.append(lq[0].cpu())
                chain = y[pos + 1 : pos + 1 + c]
                if chain.numel() < c or pos + c + 1 >= len(cont):
                    break
                tree = rt._chain(torch.cat([st.root, chain])[None])  # advance: verify the true chain and commit
                nodes, num, emitted, aux = rt._verify(st, tree, stats)
                if emitted[0, : c + 1].tolist() != cont[pos + 1 : pos + c + 2]:
                    break  # verify disagrees with the continuation (numerics): stop this prompt here
                rt._commit(st, tree, nodes, num, emitted, aux, True, stats)
                st.L_host = [h + c + 1 for h in st.L_host]
                pos += c + 1
    rt.spec = saved_spec
    if not rows:
        raise ValueError("no acceptance samples: the prompts gave no continuation to measure on")
    return AcceptanceProfile.from_ranks(torch.stack(rows), max_rank, torch.stack(logqs)), len(rows)


# ================================================================== end to end
@dataclass
class Check:
    """Predicted vs measured for one shape. Speedups are decode-phase tokens/s over plain decoding
    (same prompts, same process; the prefill, which no tree shape changes, excluded); the
    end-to-end figure includes the prefill."""

    spec: SpecConfig
    role: str
    predicted_tau: float
    measured_tau: float
    predicted_round_ms: float
    measured_round_ms: float
    predicted_speedup: float
    measured_speedup: float
    end_to_end_speedup: float
    predicted_split_ms: dict = field(default_factory=dict)  # draft / verify / commit / other per round
    measured_split_ms: dict = field(default_factory=dict)


@dataclass
class Measured:
    tokens: int
    wall_s: float
    prefill_s: float
    rounds: int
    accepted: int
    n_prompts: int = 0
    split_s: dict = field(default_factory=dict)  # summed time_split_s (prefill / draft / verify / commit)
    token_ids: list = field(default_factory=list)  # per prompt

    @property
    def decode_tokens_per_s(self) -> float:  # each prompt's first token comes from the prefill
        return (self.tokens - self.n_prompts) / max(self.wall_s - self.prefill_s, 1e-12)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tau(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 1.0

    @property
    def round_s(self) -> float:
        return (self.wall_s - self.prefill_s) / max(self.rounds, 1)


@dataclass
class TreeTuneResult:
    best: Prediction
    checks: list[Check]
    costs: CostModel
    acceptance: AcceptanceProfile
    plain: Measured
    n_roots: int
    profile_path: Path | None
    key: dict
    top: list[Prediction]

    def table(self) -> str:
        rows = [("shape (D, K, N)", "role", "pred tau", "meas tau", "pred ms/round", "meas ms/round", "pred speedup",
                 "meas speedup", "end-to-end")]
        for c in self.checks:
            s = c.spec
            rows.append((f"({s.num_speculative_tokens}, {s.top_k}, {s.num_draft_tokens})", c.role,
                         f"{c.predicted_tau:.2f}", f"{c.measured_tau:.2f}", f"{c.predicted_round_ms:.2f}",
                         f"{c.measured_round_ms:.2f}", f"{c.predicted_speedup:.2f}x", f"{c.measured_speedup:.2f}x",
                         f"{c.end_to_end_speedup:.2f}x"))
        p = self.plain
        rows.append(("plain decoding", "baseline", "1.00", "1.00", f"{self.costs.plain_token_s * 1e3:.2f}",
                     f"{p.round_s * 1e3:.2f}", f"({p.decode_tokens_per_s:.1f} tok/s)", "1.00x", "1.00x"))
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows)


def _measure(rt, prompts, max_new_tokens, specs: list[SpecConfig | None]) -> list[Measured]:
    """Generate every prompt at batch size 1 with each shape (None = plain decoding), shapes
    interleaved per prompt so that a change of machine load hits them all alike."""
    ms = [Measured(0, 0.0, 0.0, 0, 0, len(prompts)) for _ in specs]
    for spec in specs:  # first calls untimed: JIT and, on a GPU, the CUDA-graph capture of each shape
        if spec is not None:
            rt.spec = spec
        rt.generate([prompts[0]], max_new_tokens=4, speculative=spec is not None, stop_token_ids=[])
    for p in prompts:
        for spec, m in zip(specs, ms):
            if spec is not None:
                rt.spec = spec
            out = rt.generate([p], max_new_tokens=max_new_tokens, speculative=spec is not None, stop_token_ids=[])
            st = out.stats
            m.token_ids.append(out.token_ids[0])
            m.tokens += st.num_new_tokens
            m.wall_s += st.wall_time_s
            m.prefill_s += st.time_split_s.get("prefill", 0.0)
            m.rounds += st.num_drafts if spec is not None else st.num_new_tokens - 1
            m.accepted += st.num_accepted_tokens
            for k, v in st.time_split_s.items():
                m.split_s[k] = m.split_s.get(k, 0.0) + v
    return ms


def tune_tree(target: Any, drafter: Any, prompts: Sequence[str] | Sequence[Sequence[int]], *,
              device: str = "cpu", dtype: torch.dtype | None = None, backend: str = "auto",
              max_new_tokens: int = 64, max_depth: int = 8, top_ks: Sequence[int] = TOP_KS,
              max_draft_tokens: int = 64, stride: int = 1, reps: int = 7, out_dir: str | Path | None = None,
              dry_run: bool = False, validate: bool = True, log=None) -> TreeTuneResult:
    """Measure costs and the acceptance profile, pick the best shape, check it, write the profile.

    ``target``/``drafter``: directories or loaded objects, as ``SpeculativeRuntime.from_pretrained``
    takes them. ``prompts``: strings (needs the target's tokenizer) or token id lists.
    ``validate``: generate with the chosen shape, two neighbours and the default ``SpecConfig()``
    and report measured against predicted speedups.
    """
    from ..runtime.drafter import Eagle3Drafter
    from ..runtime.engine import SpeculativeRuntime
    from ..runtime.weights import load_tokenizer
    from ..runtime.target import TargetModel

    say = log or (lambda *_: None)
    tm = TargetModel.from_pretrained(target, device=device, dtype=dtype)
    d = Eagle3Drafter.from_pretrained(drafter) if isinstance(drafter, (str, Path)) else drafter
    key = {"target": prof.target_fingerprint(tm), "drafter": prof.drafter_fingerprint(d)}
    tok = load_tokenizer(Path(target)) if isinstance(target, (str, Path)) else None
    top_ks = sorted(k for k in set(top_ks) if k <= d.config.draft_vocab_size)
    kmax, nmax = max(top_ks), max_draft_tokens
    if any(isinstance(p, str) for p in prompts) and tok is None:
        raise ValueError("string prompts need the target's tokenizer; pass token id lists")
    ids = [list(tok(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts]
    longest = max(len(p) for p in ids)
    big = SpecConfig(max_depth, kmax, max(2, min(kmax + (max_depth - 1) * kmax * kmax + 1, nmax)))
    rt = SpeculativeRuntime(tm, d, tok, backend=backend, spec=big, max_batch_size=1,
                            max_seq_len=min(longest + max_new_tokens + 2 * max_depth + 8, tm.max_position_embeddings))
    key.update(device=prof.device_key(rt.device), dtype=store.dtype_name(tm.dtype), backend=rt.backend)
    say(f"[autotune tree] target={key['target']} drafter={key['drafter']} device={key['device']} "
        f"backend={rt.backend} prompts={len(ids)}")

    _measure(rt, ids, max_new_tokens, [None])  # warm-up pass: first runs at each prompt length are slow
    plain = _measure(rt, ids, max_new_tokens, [None])[0]
    conts = plain.token_ids  # the target's greedy continuations (speculative output is identical)
    say(f"[autotune tree] plain decoding: {plain.decode_tokens_per_s:.1f} tokens/s; measuring costs ...")
    costs = measure_costs(rt, ids[0], max_depth=max_depth, top_ks=top_ks, max_n=nmax, reps=reps)
    # host work per round outside draft/verify/commit, read off plain decoding (the same for every shape)
    costs.overhead_s = max(plain.round_s - costs.plain_s, 0.0)
    say("[autotune tree] measuring the acceptance profile (teacher-forced drafts) ...")
    acc, n_roots = measure_acceptance(rt, ids, conts, max_depth=max_depth, max_rank=kmax, stride=stride)
    ranked = search(costs, acc, max_depth=max_depth, top_ks=top_ks, max_draft_tokens=nmax)
    best = ranked[0]
    checks: list[Check] = []
    if validate:
        default = SpecConfig()
        shapes = [(best.spec, "chosen")] + [(n.spec, "neighbour") for n in neighbours(best.spec, ranked)]
        fits = (default.num_speculative_tokens <= max_depth and default.top_k <= kmax
                and default.num_draft_tokens <= big.num_draft_tokens)
        if fits and all(s != default for s, _ in shapes):
            shapes.append((default, "default"))
        say(f"[autotune tree] checking {len(shapes)} shapes against plain decoding ...")
        plain, *ms = _measure(rt, ids, max_new_tokens, [None] + [spec for spec, _ in shapes])
        for (spec, role), m in zip(shapes, ms):
            pred = predict(spec, costs, acc)
            D, K, N = spec.num_speculative_tokens, spec.top_k, spec.num_draft_tokens
            psplit = {"draft": costs.draft(D, K), "verify": costs.verify(N), "commit": costs.commit(D),
                      "other": costs.overhead_s}
            msplit = {k: m.split_s.get(k, 0.0) / max(m.rounds, 1) for k in ("draft", "verify", "commit")}
            msplit["other"] = m.round_s - sum(msplit.values())
            checks.append(Check(spec, role, pred.tokens_per_round, m.tau, pred.round_s * 1e3, m.round_s * 1e3,
                                pred.speedup, m.decode_tokens_per_s / plain.decode_tokens_per_s,
                                m.tokens_per_s / plain.tokens_per_s,
                                {k: round(v * 1e3, 3) for k, v in psplit.items()},
                                {k: round(v * 1e3, 3) for k, v in msplit.items()}))
            say(f"[autotune tree] {role} {spec}: predicted {pred.speedup:.2f}x, measured {checks[-1].measured_speedup:.2f}x")
    path = None
    if not dry_run:
        path = write_profile(out_dir, key, best, costs, acc, checks, plain, n_roots, max_new_tokens)
    rt.spec = big
    return TreeTuneResult(best, checks, costs, acc, plain, n_roots, path, key, ranked[:10])


def write_profile(out_dir, key: dict, best: Prediction, costs: CostModel, acc: AcceptanceProfile, checks: list[Check],
                  plain: Measured, n_roots: int, max_new_tokens: int) -> Path:
    out = Path(out_dir) if out_dir is not None else store.user_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = prof.profile_name(key["target"], key["drafter"], key["device"], key["dtype"], key["backend"])
    s = best.spec
    data = {
        "kind": prof.KIND, "target": key["target"], "drafter": key["drafter"], "device_name": key["device"],
        "dtype": key["dtype"], "backend": key["backend"], "versions": store.versions(), "threads": torch.get_num_threads(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec": {"num_speculative_tokens": s.num_speculative_tokens, "top_k": s.top_k, "num_draft_tokens": s.num_draft_tokens},
        "predicted": {"tokens_per_round": best.tokens_per_round, "round_s": best.round_s, "speedup": best.speedup},
        "measured_with": {"prompts": plain.n_prompts, "max_new_tokens": max_new_tokens, "acceptance_roots": n_roots,
                          "plain_decode_tokens_per_s": plain.decode_tokens_per_s, "batch_size": 1},
        "costs": asdict(costs), "acceptance": asdict(acc),
        "checks": [{**asdict(c), "spec": [c.spec.num_speculative_tokens, c.spec.top_k, c.spec.num_draft_tokens]}
                   for c in checks],
    }
    path = out / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
