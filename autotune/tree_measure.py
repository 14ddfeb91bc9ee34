"""The tree tuner's measurements, all through the runtime's own decoder (``runtime/decode.py``).

* ``measure_costs``: the round pieces of the cost model (``tree_model.CostModel``) timed on this
  device and backend: ``Decoder.draft`` at each top_k (depth 1 and the maximum depth),
  ``Decoder.verify`` over trees of N tokens, ``Decoder.commit`` of chains of depth 1 and the
  maximum, and the commit of plain decoding. Every cost is measured through the decoder's own
  round steps, so what is timed is what runs.
* ``measure_acceptance``: the acceptance profile ``p(d, r)`` (``tree_model.AcceptanceProfile``),
  measured by teacher forcing: for sample prompts the target's greedy continuation is generated,
  then at each root the drafter drafts a chain along the *true* tokens (``Decoder.draft_chain``,
  the drafter loop the runtime drafts with) and the rank of each true token in its draft
  distribution is recorded, with the drafter's top log-probabilities (the scores EAGLE-2 ranks by).
* ``measure_generation``: end-to-end generation with given shapes against plain decoding (the
  tuner's check of its prediction).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..runtime.bench import device_sync
from ..runtime.config import SpecConfig
from ..runtime.decode import Decoder, DraftTree
from ..runtime.shape_model import AcceptanceProfile, CostModel
from .tree_model import _monotone

VERIFY_NS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@contextlib.contextmanager
def using_spec(rt, spec: SpecConfig) -> Iterator[None]:
    """Run rounds (``rt.generate``, ``Decoder.round``/``collect``) with ``spec`` inside the block."""
    saved = rt.spec
    rt.spec = spec
    try:
        yield
    finally:
        rt.spec = saved


# ================================================================== costs
def _heap_tree(root: torch.Tensor, n: int, vocab: int) -> DraftTree:
    """A synthetic n-node tree (binary heap: node i's parent is (i-1)//2) for timing verify(n)."""
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
    return DraftTree(
        tokens,
        parents[None].expand(B, n).clone(),
        depth[None].expand(B, n).clone(),
        mask[None].expand(B, n, n),
        int(depth.max()),
    )


def measure_costs(
    rt,
    prompt_ids: list[int],
    *,
    max_depth: int,
    top_ks: Sequence[int],
    verify_ns: Sequence[int] = VERIFY_NS,
    max_n: int = 64,
    reps: int = 5,
) -> CostModel:
    """Time the round pieces at batch size 1 on a context of ``len(prompt_ids)`` tokens.

    Round robin: each repetition times every piece once, in turn (a warm-up pass first), so a
    change of machine load spreads over all pieces instead of skewing one, and no piece is timed
    with caches left warm by its own previous call. Means over ``reps``.

    The speculative pieces run on ``rt.decoder``; the plain-decoding commit (no drafter catch-up)
    on a drafter-less ``Decoder`` sharing the target, prefilled with the same prompt."""
    dec = rt.decoder
    dev = dec.device
    with torch.inference_mode():
        dec.prefill([prompt_ids], speculative=True)
        snap = dec.snapshot()  # commit advances the state: each timed commit starts from here
        room = dec.target.k_cache.shape[2] - 1 - len(prompt_ids)  # tree slots after the prompt
        ns = sorted({1, 2} | {n for n in verify_ns if n <= min(room, max_n)})
        items = {}  # key -> (timed call, untimed restore or None)
        for n in ns:
            tree = dec.root_tree() if n == 1 else _heap_tree(dec.root, n, dec.target.vocab_size)
            items["verify", n] = (lambda tree=tree: dec.verify(tree), None)
        depths = sorted({1, max_depth})
        for K in top_ks:
            for D in depths:
                spec = SpecConfig(D, K, min(K + (D - 1) * K * K + 1, 64))
                items["draft", D, K] = (lambda spec=spec: dec.draft(spec=spec), None)
        for D in depths:
            tree = dec.draft(spec=SpecConfig.chain(D))
            v = dec.verify(tree)
            items["commit", D] = (lambda tree=tree, v=v: dec.commit(tree, v), lambda: dec.restore(snap))
        plain = Decoder(dec.target, None, dec.ops, dec.spec, max_batch_size=1, max_seq_len=dec.max_seq_len)
        plain.prefill([prompt_ids], speculative=False)
        plain_snap = plain.snapshot()
        root = plain.root_tree()
        vroot = plain.verify(root)
        items["plain_commit"] = (lambda: plain.commit(root, vroot), lambda: plain.restore(plain_snap))
        times: dict = {k: [] for k in items}
        for rep in range(reps + 1):
            for k, (fn, after) in items.items():
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
    verify_s = [med["verify", n] for n in ns]
    span = max(max_depth - 1, 1)
    head = {K: med["draft", 1, K] for K in top_ks}
    step = {K: max((med["draft", max_depth, K] - med["draft", 1, K]) / span, 0.0) for K in top_ks}
    b = max((med["commit", max_depth] - med["commit", 1]) / span, 0.0)
    return CostModel(ns, _monotone(verify_s), head, step, (med["commit", 1] - b, b), verify_s[0] + med["plain_commit"])


# ================================================================== acceptance
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


def forced_chain_ranks(
    dec: Decoder, future: torch.Tensor, max_rank: int, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft from the decoder's current state: the drafter drafts a chain along
    ``future [B, D]`` (the true next tokens, -1 = unknown) with the decoder's own chain loop
    (``Decoder.draft_chain``, its pick feeding the true token at each depth); returns each true
    token's rank in the log q of its depth ``[B, D]`` (-1: beyond max_rank, -2: unknown) and the
    drafter's top log-probabilities ``[B, D, max_rank]``."""
    truth = future.clamp(min=0)
    _, lps = dec.draft_chain(future.shape[1], lambda s, lp: truth[:, s])  # lps[s]: the log q pick s saw
    r = torch.stack([_rank(lp, t2d[truth[:, s]], max_rank) for s, lp in enumerate(lps)], 1)
    tops = torch.stack([lp.topk(max_rank, dim=-1).values for lp in lps], 1)
    return torch.where(future >= 0, r, -2), tops.float()


def measure_acceptance(
    rt, prompts: list[list[int]], continuations: list[list[int]], *, max_depth: int, max_rank: int, stride: int = 1
) -> tuple[AcceptanceProfile, int]:
    """Teacher-forced ranks at roots every ``stride + 1`` tokens of each continuation (the target's
    greedy output). Returns the profile and the number of roots sampled.

    Between roots the decoder advances by verifying and committing the true chain of ``stride``
    tokens; its rounds run with that chain's shape (``rt.spec``, which ``collect`` reads)."""
    dec = rt.decoder
    dev = dec.device
    t2d = _draft_ids(dec.drafter, dec.target.vocab_size, dev)
    rows, logqs = [], []
    c = max(stride, 1)
    with using_spec(rt, SpecConfig.chain(c)), torch.inference_mode():
        for prompt, cont in zip(prompts, continuations):
            dec.prefill([prompt], speculative=True)
            if dec.first_tokens()[0] != cont[0]:
                continue
            y = torch.tensor(cont, device=dev)
            pos = 0
            while pos + 1 < len(cont) and max(dec.lengths) + c + 1 < dec.max_seq_len:
                fut = torch.full((1, max_depth), -1, dtype=torch.int64, device=dev)
                nxt = y[pos + 1 : pos + 1 + max_depth]
                fut[0, : nxt.numel()] = nxt
                r, lq = forced_chain_ranks(dec, fut, max_rank, t2d)
                rows.append(r[0].cpu())
                logqs.append(lq[0].cpu())
                chain = y[pos + 1 : pos + 1 + c]
                if chain.numel() < c or pos + c + 1 >= len(cont):
                    break
                tree = dec.chain_tree(torch.cat([dec.root, chain])[None])  # advance: verify the true chain and commit
                v = dec.verify(tree)
                if v.emitted[0, : c + 1].tolist() != cont[pos + 1 : pos + c + 2]:
                    break  # verify disagrees with the continuation (numerics): stop this prompt here
                dec.commit(tree, v)
                dec.collect()  # the host lengths advance by the c + 1 tokens
                pos += c + 1
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


def measure_generation(
    rt,
    prompts,
    max_new_tokens,
    specs: list[SpecConfig | None],
    *,
    batch_size: int = 1,
    temperature: float = 0.0,
    repeats: int = 1,
) -> list[Measured]:
    """Generate every prompt with each shape (None = plain decoding), ``batch_size`` prompts per
    call (the prompt list repeats to fill a batch), shapes interleaved per batch so that a change
    of machine load hits them all alike; at ``temperature > 0`` sampled with fixed seeds.
    ``repeats > 1`` runs the whole set again, the shapes in reverse order on every other pass
    (A B C, C B A, ...) so a load that drifts during a batch does not favour the first shape; the
    totals sum over passes (token ids too). ``rt.spec`` is left as it was."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    n = max(len(prompts), batch_size)
    pool = [prompts[i % len(prompts)] for i in range(n)]
    groups = [pool[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    kw = dict(temperature=temperature, seed=list(range(batch_size)), stop_token_ids=[])

    def generate(group, k, spec):
        if spec is None:
            return rt.generate(group, max_new_tokens=k, speculative=False, **kw)
        with using_spec(rt, spec):
            return rt.generate(group, max_new_tokens=k, speculative=True, **kw)

    ms = [Measured(0, 0.0, 0.0, 0, 0, batch_size * len(groups) * repeats) for _ in specs]
    # first calls untimed: JIT and, on a GPU, the CUDA-graph capture of each shape; compiled CPU rounds
    # compile one artefact per key (shape, batch, attention bound), so every generation is run once
    compiled = getattr(rt, "compiled", False)
    for spec in specs:
        for group in groups if compiled else groups[:1]:
            generate(group, max_new_tokens if compiled else 4, spec)
    order = list(zip(specs, ms))
    for rep in range(repeats):
        for group in groups:
            for spec, m in order if rep % 2 == 0 else order[::-1]:
                _measure_one(m, generate(group, max_new_tokens, spec), spec, len(group))
    return ms


def _measure_one(m: Measured, out, spec: SpecConfig | None, rows: int) -> None:
    """Add one ``generate`` call's stats to ``m``."""
    st = out.stats
    m.token_ids += out.token_ids
    m.tokens += st.num_new_tokens
    m.wall_s += st.wall_time_s
    m.prefill_s += st.time_split_s.get("prefill", 0.0)
    m.rounds += st.num_drafts if spec is not None else st.num_new_tokens - rows
    m.accepted += st.num_accepted_tokens
    for k, v in st.time_split_s.items():
        m.split_s[k] = m.split_s.get(k, 0.0) + v
