"""``Decoder``: the decode state of a batch and the steps of a speculative round.

One round, for a batch of B rows with committed target length ``L[b]`` and root token
``root[b]`` (emitted, not yet in the cache)::

    draft   the drafter expands an EAGLE-2 tree from its last catch-up state (``tree.py``), or
            draws a chain from its distribution (``top_k=1`` at temperature > 0); with
            ``prompt_lookup_num_tokens``, a prompt-lookup chain from the token history ``hist`` is
            grafted onto the tree (``ngram.py``)
    verify  the target runs [root + N-1 nodes] at slots L..L+N-1 under the tree mask; greedy or
            lossless sampling verification picks the accepted path and the bonus token
    commit  the accepted path's K/V moves to slots L..L+a (kv_compact); the drafter re-encodes
            positions L..L+a with the target's true aux states (catch-up); L += a+1; the emitted
            tokens and their count go to ``out``

``round`` runs the three on the static buffers only (``DecodeBuffers``: lengths, roots, drafter
states, random keys/counters, the emitted-token row, plus both KV caches), in place, with fixed
shapes and no host synchronisation: a CUDA graph captures it (``runtime/graphs.py``) and eager
execution calls the very same function. ``collect`` is the round's one host sync: it reads the
emitted tokens and advances the host-side lengths; ``finish`` retires rows. Plain decoding is the
same round with a tree that is only the root.

Users of the steps (the engine, ``runtime/bench.py``, the tree tuner, training evaluation) call
these methods and never touch the bookkeeping themselves.

Examples
--------
>>> dec = rt.decoder                                                   # doctest: +SKIP
>>> dec.prefill([[1, 2, 3]], speculative=True)                         # doctest: +SKIP
>>> tree = dec.draft(); v = dec.verify(tree); dec.commit(tree, v)      # doctest: +SKIP
>>> dec.collect()                                                      # doctest: +SKIP
[[17, 9, 4]]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from ..kernels import cpu_linear as _cpu_linear
from ..kernels import cpu_tree
from .config import SpecConfig
from .deterministic import position_race
from .errors import UserError
from .metadata import AttentionMetadata, KVCache
from .ngram import graft_chain, ngram_lookup
from .sampling import RowRandom, SamplingParams, process_logits
from .tree import build_tree, rerank, topk_stable

if TYPE_CHECKING:
    from .drafter import Eagle3Drafter
    from .ops import Ops
    from .target import TargetModel


KV_BUCKET_MIN = 256  # smallest attention bound of a compiled round (``Decoder.kv_bucket``)
# A batch's prompt forward is [B, P], every prompt padded to the longest. On a CPU, where a long prompt's
# matmuls already run near the BLAS's speed one prompt at a time, the prompts run one at a time when
# padding is more than this share of the batch's tokens (and the batch at least PREFILL_SPLIT_MIN_TOKENS):
# the demo pair at batch 4, standard prompts of 786/775/500/256 and 328/58/246/564 tokens, one thread:
# 425 -> 298 ms and 276 -> 139 ms a prefill (2026-12-04). Each row's caches, first token and drafter
# state are then those of its solo run.
PREFILL_SPLIT_PAD = 0.125
PREFILL_SPLIT_MIN_TOKENS = 256
# ... and whatever the padding, when the batch holds at least this many padded tokens: the activations of
# so many rows fall out of the caches, and every op runs slower per row than on one prompt's rows. Intel
# Xeon (AMX), 2026-12-06, equal-length prompts, prompt by prompt over batched: the demo pair (one thread)
# 8 x 1,024 tokens 0.77x, 4 x 1,024 0.84x, 8 x 512 0.91x, 4 x 512 1.02x, 8 x 256 1.21x; SmolLM2 (two
# threads) 8 x 512 0.91x, 4 x 512 1.02x, 8 x 256 1.03x, 8 x 128 1.32x (short prompts gain from one forward:
# each forward reads every weight once and pays every op's call). 8 long demo prompts of 1,522-1,766 tokens
# (7 % padding): 1.52-1.90 s batched, 1.13-1.26 s prompt by prompt.
PREFILL_SPLIT_TOKENS = 4096


@dataclass
class DraftTree:
    """A draft tree of N nodes per row, node 0 the root (``kernels/verify.py`` conventions)."""

    tokens: torch.Tensor  # [B, N] target ids, node 0 = root
    parents: torch.Tensor  # [B, N] parent node, -1 for the root and padding
    depth: torch.Tensor  # [B, N] depth of each node (root 0)
    mask: torch.Tensor  # [B, N, N] bool: node i sees node j (its ancestors and itself)
    max_depth: int
    draft_probs: torch.Tensor | None = None  # [B, N-1, V] q of each node of a sampled chain (verify_chain)


@dataclass
class Verification:
    """What verification accepted, per row."""

    nodes: torch.Tensor  # [B, D+1] accepted node ids along the path (root first), -1 = none
    num: torch.Tensor  # [B] accepted draft tokens (the root excluded)
    emitted: torch.Tensor  # [B, D+1] the accepted draft tokens, then the bonus token, -1 padded
    aux: torch.Tensor | None  # [B, N, n_aux*H_t] the target's aux states of every tree node (drafting only)
    finite: torch.Tensor | None = None  # [B] bool: the target's hidden states were finite (no NaN/inf)


class DraftObserver(Protocol):
    """Diagnostics hooks of the drafter's forwards (``runtime/drift.py``'s ``DriftRecorder``).

    ``wrap`` returns the ops the drafter steps run with (it may record attention); the ``on_*``
    calls follow each drafter forward. An observed decoder runs eagerly (never in a graph)."""

    def wrap(self, ops: Ops) -> Ops: ...

    def on_catch_up(self, last: torch.Tensor, prefix_lens: torch.Tensor) -> None: ...

    def on_depth1(self, carry: torch.Tensor, active: torch.Tensor) -> None: ...

    def on_step(self, depth: int, prefix_lens: torch.Tensor, carry: torch.Tensor, active: torch.Tensor) -> None: ...


class DecodeBuffers:
    """Static decode state for ``max_batch`` rows; a round's tensors are views ``[:rows]``."""

    def __init__(
        self, max_batch: int, hidden: int | None, width: int, history: int, device: torch.device, dtype: torch.dtype
    ):
        i64 = dict(dtype=torch.int64, device=device)
        self.L = torch.zeros(max_batch, **i64)  # [Bmax] committed target length (= drafter's encoded length)
        self.root = torch.zeros(max_batch, **i64)  # [Bmax] last emitted token
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=device)  # [Bmax]
        self.key = torch.zeros(max_batch, **i64)  # [Bmax] random key per request (sampling.RowRandom)
        self.counter = torch.zeros(max_batch, **i64)  # [Bmax] rounds drawn per request
        self.out = torch.zeros(max_batch, width, **i64)  # [Bmax, D+3] emitted tokens, their count; last: drafted
        self.hist = torch.zeros(max_batch, history, **i64)  # [Bmax, S] token at each position, root at L
        h = (max_batch, hidden) if hidden else (max_batch, 0)
        self.hn = torch.zeros(h, device=device, dtype=dtype)  # [Bmax, H] drafter normed hidden at L-1
        self.carry = torch.zeros(h, device=device, dtype=dtype)  # [Bmax, H] drafter carry at L-1

    def tensors(self) -> list[torch.Tensor]:
        return [self.L, self.root, self.active, self.key, self.counter, self.out, self.hist, self.hn, self.carry]


@dataclass
class Snapshot:
    """The state a step changes (``Decoder.snapshot`` / ``restore``), for measuring steps repeatedly."""

    tensors: list[torch.Tensor]
    lengths: list[int]


class Decoder:
    """The decode state of up to ``max_batch_size`` rows and the steps of a round.

    Parameters
    ----------
    target, drafter : the models (``drafter=None``: plain decoding only).
    ops : the backend (``runtime/ops.py``).
    spec : the draft-tree shape; ``spec`` is read at every draft (settable).
    max_batch_size, max_seq_len : static cache sizes (max_seq_len = prompt + generated).

    Attributes
    ----------
    rows : rows of the round's tensors (live rows plus idle padding up to a graph bucket).
    lengths : host copy of the committed lengths ``L`` (kept by ``collect``/``finish`` only).
    running : host flags of the rows still decoding.
    L, root, active, hn, carry, out : the round's views ``[:rows]`` of the static buffers.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Eagle3Drafter | None,
        ops: Ops,
        spec: SpecConfig,
        *,
        max_batch_size: int,
        max_seq_len: int,
        capacity: SpecConfig | None = None,
    ):
        self.target, self.drafter, self.ops, self.spec = target, drafter, ops, spec
        self.device = target.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.observer: DraftObserver | None = None
        self._chains: dict[tuple[int, int], tuple] = {}  # (rows, nodes) -> chain parents, depths, mask
        self.draft_cache: KVCache | None = None
        self.drafter_capacity = self._max_depth = 0
        if drafter is not None:
            self.d2t = drafter.target_ids()  # [Vd] target ids, for the sampled chain
        self._fit(capacity or spec)
        self.bufs = self._new_buffers()
        self.rows = self.num_prompts = 0
        self.lengths: list[int] = []
        self.running: list[bool] = []
        self.sampling = SamplingParams()
        self.rng: RowRandom | None = None
        self.speculative = False
        self.deterministic = False  # sample by position_race (runtime/deterministic.py); set by the engine
        self.pad_root = False  # plain rounds verify root + a padding node (deterministic mode on probed ops)
        self._kv_cap: int | None = None  # attention bound of a whole-cache round (``round(kv_cap=)``)
        self._cut_nodes: int | None = None  # draft nodes of the last eager CPU round that cut its lookup padding
        self.top1_chains = True  # a top-1 tree keeping every candidate is drafted as a chain (``draft``)
        self.native_chains = True  # chains (greedy, sampled) and top-k trees: one native call where it runs
        self.native_catch_ups = True  # commit's catch-up in one native call where it runs (_native_catch_up)
        self.native_history = True  # commit's token history and drafted count in one C call (_commit_history)
        self.track_drafted = False  # commit records each row's accepted drafter nodes (adaptive shapes)
        self.drafted: list[int] = []  # per row, by collect when tracked: accepted drafter nodes, -1: lookup's path

    def _fit(self, spec: SpecConfig) -> None:
        """Grow the caches (never shrink) so that ``spec`` fits: the target's ``max_seq_len + N``
        slots, the drafter's ``max_seq_len`` plus the widest tree level's slots."""
        K, D = spec.top_k, spec.num_speculative_tokens
        self._max_depth = max(self._max_depth, spec.tree_depth)
        self.target.allocate_cache(self.max_batch_size, self.max_seq_len + spec.verify_tokens)
        need = self.max_seq_len + max((D - 1) * K, spec.tree_depth + 1)
        if self.drafter is not None and need > self.drafter_capacity:
            self.drafter_capacity = need
            c = self.drafter.config
            shape = (self.max_batch_size, need + 1, c.num_key_value_heads, c.head_dim)
            dt = self.target.dtype
            self.draft_cache = KVCache(
                torch.zeros(shape, device=self.device, dtype=dt), torch.zeros(shape, device=self.device, dtype=dt)
            )
            self.drafter.rope(need + 1)

    def fit(self, specs: Sequence[SpecConfig]) -> None:
        """Grow the caches so that every shape of ``specs`` fits (before a prefill whose request may
        switch among them, ``runtime/adaptive.py``; the prefill regrows the round buffers)."""
        with torch.inference_mode(False):
            for s in specs:
                self._fit(s)

    def _new_buffers(self) -> DecodeBuffers:
        hidden = self.drafter.config.hidden_size if self.drafter is not None else None
        depth = self._max_depth
        history = self.max_seq_len + depth + 2  # a round's last emitted token lands at most at max_seq_len + depth + 1
        return DecodeBuffers(self.max_batch_size, hidden, depth + 3, history, self.device, self.target.dtype)

    # ================================================================== state
    def narrow(self, rows: int) -> None:
        """Point the round's tensors at rows ``[:rows]`` of the static buffers."""
        b = self.bufs
        self.rows = rows
        self.L, self.root, self.active = b.L[:rows], b.root[:rows], b.active[:rows]  # [rows]
        self.hn, self.carry = b.hn[:rows], b.carry[:rows]  # [rows, H]
        self.out = b.out[:rows]  # [rows, D+3]
        if self.rng is not None:
            self.rng.key, self.rng.counter = b.key[:rows], b.counter[:rows]

    def collect(self) -> list[list[int]]:
        """The round's one host sync: each running row's emitted tokens (``[]`` for the others);
        advances the host lengths by as many tokens. A row whose target hidden states were not
        finite (``commit`` wrote count -1) raises a ``UserError``."""
        width = self.emitted_width
        em = (self.out if self.track_drafted else self.out[:, :width]).tolist()
        if self.track_drafted:  # the drafter tree's share of each row's accepted path (commit)
            self.drafted = [row[-1] for row in em]
        bad = [b for b, (row, run) in enumerate(zip(em, self.running)) if run and row[width - 1] < 0]
        if bad:
            raise not_finite(bad, "decoding", self.target.dtype)
        new = [row[: row[width - 1] + 1] if run else [] for row, run in zip(em, self.running)]
        for b, toks in enumerate(new):
            self.lengths[b] += len(toks)
        return new

    @property
    def emitted_width(self) -> int:
        """Columns of ``out`` a round writes: D+1 emitted tokens (1 when plain), then their count."""
        return (self.spec.tree_depth if self.speculative else 0) + 2

    def first_tokens(self) -> list[int]:
        """The token the prefill picked per row (a host sync)."""
        return self.root[: self.num_prompts].tolist()

    def finish(self, rows: Sequence[int]) -> None:
        """Retire rows: they idle at L=0 (so they never write past their cache) and write nowhere."""
        for b in rows:
            self.running[b] = False
            self.lengths[b] = 0
        if rows:  # a host-side list: no device read; the whole buffers, so a later widened round finds them idle
            idx = torch.tensor(list(rows), device=self.device)
            self.bufs.L.index_fill_(0, idx, 0)
            self.bufs.active.index_fill_(0, idx, False)

    @property
    def rows_in_place(self) -> bool:
        """Whether something watches the batch by row position and forward: an observer (observed decoding
        counts one static batch's forwards) or an ops proxy that reads the host (the audit's recorder keeps
        rows by position and the prefill's head rows as the batch's). Then a batch prefills in one forward
        and its rows never move (``_prefill_groups``, ``move_row``)."""
        return self.observer is not None or bool(getattr(self.ops, "reads_host", False))

    def move_row(self, src: int, dst: int) -> None:
        """Move the running row ``src`` into the finished row ``dst < src`` and retire ``src``: both models'
        K/V of its committed positions, its buffers (length, root, drafter state, history, random stream)
        and host state. The round can then narrow past ``src`` instead of computing a finished row in the
        middle of the batch as idle padding. Its later tokens are those it would have emitted from ``src``:
        every op of a round works row by row. A copy of ``L`` slots per layer (continuous batching's tail,
        ``SpeculativeRuntime._decode``)."""
        if not (0 <= dst < src < len(self.running)) or not self.running[src] or self.running[dst]:
            raise ValueError(f"move_row({src}, {dst}): needs a running row after a finished one")
        n = self.lengths[src]  # committed slots: the next round writes from slot n on, in both caches
        t = self.target
        for c in (t.k_cache, t.v_cache):
            c[:, dst, :n].copy_(c[:, src, :n])
        if self.speculative and self.draft_cache is not None:
            for c in (self.draft_cache.k, self.draft_cache.v):
                c[dst, :n].copy_(c[src, :n])
        for buf in self.bufs.tensors():
            buf[dst].copy_(buf[src])
        self.running[dst], self.lengths[dst] = True, n
        self.finish([src])

    def snapshot(self) -> Snapshot:
        """Copy the state a draft/verify/commit changes (lengths, roots, drafter states)."""
        return Snapshot([t.clone() for t in (self.L, self.root, self.hn, self.carry)], list(self.lengths))

    def restore(self, snap: Snapshot) -> None:
        for t, s in zip((self.L, self.root, self.hn, self.carry), snap.tensors):
            t.copy_(s)
        self.lengths = list(snap.lengths)

    def _kv_len(self, whole_cache: bool, extra: int) -> int | None:
        """Attention bound: the longest row plus ``extra`` slots; in a captured or compiled round
        (``whole_cache``), the round's ``kv_bucket`` (None: the whole cache)."""
        return self._kv_cap if whole_cache else max(self.lengths) + extra

    def kv_bucket(self) -> int | None:
        """The attention bound for a compiled round that starts now: the longest row plus the
        most slots any phase of the round adds, rounded up to a power of two of at least
        ``KV_BUCKET_MIN``; None when that reaches the smaller cache (attend over the whole cache).

        A compiled round attends up to a fixed bound; over the whole cache it would pay for every
        slot of ``max_seq_len`` (2.2x the compiled step of the demo target at 2,048 slots against
        700). Rounding up keeps the compiled artefacts few: a request compiles one per power of two
        it grows through. Host-side lengths: no device read."""
        s = self.spec
        if self.speculative:
            extra = max((s.num_speculative_tokens - 1) * s.top_k, s.verify_tokens, s.tree_depth + 2)
        else:
            extra = 2
        need = max(self.lengths, default=0) + extra
        bucket = max(KV_BUCKET_MIN, 1 << (need - 1).bit_length())
        caps = [self.target.k_cache.shape[2]]  # [L, B, S, H, D]
        if self.speculative and self.draft_cache is not None:
            caps.append(self.draft_cache.k.shape[1])  # [B, S, H, D]
        return None if bucket >= min(caps) else bucket

    # ================================================================== prefill
    def prefill(
        self,
        batch: list[list[int]],
        *,
        speculative: bool,
        sampling: SamplingParams | None = None,
        seeds: Sequence[int] | None = None,
        rows: int | None = None,
        timings: dict[str, float] | None = None,
    ) -> None:
        """Run the prompts, pick the first token of each row, encode the drafter (``speculative``).

        ``rows - len(batch)`` idle rows pad the state up to a graph bucket; ``seeds`` (one per
        prompt) seed the rows' random streams when ``sampling`` is not greedy."""
        t0 = time.perf_counter()
        sampling = sampling or SamplingParams()
        if speculative and self.drafter is None:
            raise ValueError("speculative prefill needs a drafter")
        self.speculative = speculative
        if speculative:  # runtimes may share one TargetModel (e.g. EAGLE-3 and 3.1 drafters side by side)
            self.target.set_aux_layer_ids(self.drafter.config.aux_layer_ids)
        # normal tensors, as at construction, though prefill runs in inference mode: the host-side
        # steps between rounds (finish) write them outside it
        with torch.inference_mode(False):
            # runtimes may share the target, whose cache only grows, and the spec may have grown: fit both
            self._fit(self.spec)
            if self.bufs.out.shape[1] < self._max_depth + 3:  # the tree depth grew since construction (autotune, fit)
                self.bufs = self._new_buffers()  # sized by _fit's depth
        B = len(batch)
        rows = B if rows is None else rows
        pad = rows - B
        bufs = self.bufs
        for t in bufs.tensors():  # every slot idle: continuous batching widens the round into them (admit)
            t.zero_()
        self.sampling = sampling
        self.rng = None
        self._cut_nodes = None
        if not sampling.greedy:
            seeds = [0] * B if seeds is None else list(seeds)
            self.rng = RowRandom(seeds + [0] * pad, self.device, key=bufs.key[:rows], counter=bufs.counter[:rows])
        self.num_prompts = B
        self.lengths = [len(p) for p in batch] + [0] * pad
        self.running = [True] * B + [False] * pad
        self.narrow(rows)
        for row0, group in self._prefill_groups(batch):
            self._prefill_rows(group, row0, None if self.rng is None else self.rng.rows(row0, row0 + len(group)))
        _add_time(timings, "prefill", t0)

    def _prefill_groups(self, batch: list[list[int]]) -> list[tuple[int, list[list[int]]]]:
        """``(first row, prompts)`` per prompt forward: the whole batch, or on a CPU each prompt alone
        where padding to the longest would be much of the work (``PREFILL_SPLIT_PAD``) or the batch is
        large (``PREFILL_SPLIT_TOKENS``)."""
        padded = len(batch) * max(map(len, batch))
        waste = padded - sum(map(len, batch))
        split = (
            self.device.type == "cpu"
            and not self.rows_in_place
            and len(batch) > 1
            and padded >= PREFILL_SPLIT_MIN_TOKENS
            and (waste > PREFILL_SPLIT_PAD * padded or padded >= PREFILL_SPLIT_TOKENS)
        )
        return [(b, [p]) for b, p in enumerate(batch)] if split else [(0, batch)]

    def admit(self, slot: int, prompt: list[int], seed: int = 0, *, timings: dict[str, float] | None = None) -> int:
        """Continuous batching: prefill ``prompt`` alone into the idle row ``slot`` of the running
        batch (its caches, length, root and drafter state; the other rows are untouched), with the
        batch's sampling settings and its own ``seed``. The row runs from the next round (widen the
        round with ``narrow`` when ``slot >= rows``); returns its first token (a host sync).

        The row's output equals a solo run of the prompt: every op of a round works row by row,
        and the row's random stream (``RowRandom``) depends only on its seed and its own draws."""
        t0 = time.perf_counter()
        if not 0 <= slot < self.max_batch_size:
            raise ValueError(f"slot={slot} is outside the batch's {self.max_batch_size} rows")
        if slot < len(self.running) and self.running[slot]:
            raise ValueError(f"row {slot} is still decoding: admit a prompt only into a finished row")
        if self.observer is not None:
            raise UserError("observed decoding (observe()) runs one static batch: pass at most max_batch_size prompts")
        bufs = self.bufs
        rng = None
        if not self.sampling.greedy:
            rng = RowRandom([seed], self.device, key=bufs.key[slot : slot + 1], counter=bufs.counter[slot : slot + 1])
        self._prefill_rows([prompt], slot, rng)
        grow = slot + 1 - len(self.running)
        if grow > 0:
            self.running += [False] * grow
            self.lengths += [0] * grow
        self.running[slot], self.lengths[slot] = True, len(prompt)
        _add_time(timings, "prefill", t0)
        return int(bufs.root[slot])

    def _prefill_rows(self, batch: list[list[int]], row0: int, rng: RowRandom | None) -> None:
        """The prompts' forward into cache rows ``row0..row0+B-1``, their first token (``rng``: the
        rows' random streams when sampling) and the drafter's encoding; sets those rows' state."""
        B, P = len(batch), max(len(p) for p in batch)
        dev = self.device
        lens = torch.tensor([len(p) for p in batch], device=dev)
        tokens = torch.zeros(B, P, dtype=torch.int64, device=dev)
        for b, p in enumerate(batch):
            tokens[b, : len(p)] = torch.tensor(p, device=dev)
        ar = torch.arange(P, device=dev)
        valid = ar[None, :] < lens[:, None]
        positions = ar.expand(B, P)
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(positions, torch.where(valid, positions, -1), zero, None, P, prefill=True)
        hidden, aux = self.target.forward(self.ops, tokens, meta, capture_aux=self.speculative, cache_row=row0)
        last = (lens - 1)[:, None]
        h_last = hidden.gather(1, last[..., None].expand(B, 1, hidden.shape[-1]))[:, 0]
        logits = self.target.logits(h_last, self.ops)
        finite = torch.isfinite(logits).all(-1).tolist()  # NaN weights would emit token 0 forever
        if not all(finite):
            raise not_finite([row0 + b for b, ok in enumerate(finite) if not ok], "prefill", self.target.dtype)
        sampling = self.sampling
        if sampling.greedy:
            root = logits.argmax(-1)
        elif self.deterministic:  # the token at position len(prompt), raced on (seed, position)
            root = position_race(process_logits(logits, sampling), rng.key, lens)
        else:  # the first token: an exponential-race sample of the processed distribution
            _, xi = rng.draw(1, logits.shape[-1], native=self._cpu_index())
            root = (process_logits(logits, sampling).log_softmax(-1) - xi.log()).argmax(-1)
        rows = slice(row0, row0 + B)
        bufs = self.bufs
        bufs.L[rows].copy_(lens)
        bufs.root[rows].copy_(root)
        bufs.active[rows].fill_(True)
        bufs.out[rows].zero_()
        hist = bufs.hist[rows]
        hist[:, :P].copy_(tokens)
        hist.scatter_(1, lens[:, None], root[:, None])  # the root at position len(prompt)
        if self.speculative:
            nxt = torch.cat([tokens[:, 1:], torch.zeros(B, 1, dtype=torch.int64, device=dev)], dim=1)
            nxt = nxt.scatter(1, last, root[:, None])  # pair (g_t, x_{t+1}); x_P = root
            index = torch.where(valid, torch.arange(B, device=dev)[:, None] * P + ar, -1)
            self._catch_up(aux.reshape(B * P, -1), index, nxt, lens, zero, P, prefill=True, row0=row0)

    def _catch_up(
        self,
        aux_flat: torch.Tensor,
        index: torch.Tensor,
        tokens: torch.Tensor,
        n_valid: torch.Tensor,
        start: torch.Tensor,
        kv_len: int | None,
        prefill: bool = False,
        row0: int = 0,
    ) -> None:
        """Drafter re-encodes ``n_valid`` positions from ``start`` with true target features; the
        state's rows ``row0..row0+B-1`` get the drafter's state at the last one (B = rows of
        ``index``; their drafter cache rows are written)."""
        d = self.drafter
        B, Qc = index.shape
        ar = torch.arange(Qc, device=self.device)
        g = d.combine(self.ops, aux_flat, index.reshape(-1), prompt=prefill).view(B, Qc, -1)
        positions = start[:, None] + ar
        slots = torch.where(ar[None, :] < n_valid[:, None], positions, -1)
        # a prompt's mask is implied (AttentionMetadata.prefill); a decode round's Qc = max depth + 1: the chain's
        causal = None if prefill else self._chain_consts(B, Qc)[2]
        meta = AttentionMetadata(positions, slots, start, causal, kv_len, prefill=prefill)
        cache = self.draft_cache
        if row0:  # an admitted row (continuous batching): its own cache rows
            cache = KVCache(cache.k[row0:], cache.v[row0:])
        last = (n_valid - 1).clamp(min=0)
        # a prompt's catch-up computes its last position only beyond the K/V (the observer records every
        # query's attention, so it keeps the whole forward: its depth-1 state may then differ from an
        # unobserved run's in the last bits, another attention kernel; the tokens are the target's)
        keep = last if prefill and self.observer is None else None
        hn, carry = d.step(self._drafter_ops(), g, tokens, meta, cache, keep=keep)
        if keep is None:
            at = last[:, None, None].expand(B, 1, hn.shape[-1])
            hn, carry = hn.gather(1, at), carry.gather(1, at)
        self.bufs.hn[row0 : row0 + B].copy_(hn[:, 0])
        self.bufs.carry[row0 : row0 + B].copy_(carry[:, 0])
        if self.observer is not None:  # depth 1 of the next round is this catch-up's last position
            self.observer.on_catch_up(last, start + n_valid)

    def _native_catch_up(self, tree: DraftTree, v: Verification, whole_cache: bool) -> bool:
        """``commit``'s catch-up in one native call (``Eagle3Drafter.native_catch_up``) where it runs: eager CPU
        rounds, no observer, the native drafter step. The columns re-encoded are ``commit``'s: up to the longest
        accepted path where the drafter's kernels compute each row alone, else all of them."""
        if self.observer is not None or not self.native_catch_ups or v.aux.device.type != "cpu":
            return False
        B, N = tree.tokens.shape
        # the operator runs only on packed projections with the CPU kernels: a row-invariant drafter
        # (_row_invariant_drafter), so commit's rule is up to the longest path unless whole_cache
        qc = v.nodes.shape[1] if whole_cache else -1
        return self.drafter.native_catch_up(
            self.ops, v.aux.reshape(B * N, -1), v.nodes, v.emitted, v.num, self.active, self.L, N, qc,
            self.draft_cache, self.bufs.hn[:B], self.bufs.carry[:B], self._kv_len(whole_cache, tree.max_depth + 1),
        )  # fmt: skip

    def _commit_history(self, v: Verification) -> bool:
        """``commit``'s token history and, for adaptive shapes (``track_drafted``), the drafted count as one C
        operator (``kernels.cpu_tree.commit_history``: the same integers) where the round's bookkeeping runs in C
        (``_cpu_index``); False: ``commit`` runs its PyTorch ops."""
        if not self._cpu_index() or not self.native_history:
            return False
        n_tree = self.spec.num_draft_tokens if self.track_drafted else 0
        hist = self.bufs.hist[: self.rows]
        return cpu_tree.commit_history(hist, self.L, self.root, v.emitted, v.nodes, v.num, self.out, n_tree)

    def _drafter_ops(self) -> Ops:
        return self.ops if self.observer is None else self.observer.wrap(self.ops)

    def drafter_step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
        kv_len: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward of ``tokens [B, Q]`` over the committed prefix ``L`` plus the tree
        region (``visible [B, Q, T]``); returns ``(hn, carry)`` ``[B, Q, H]``."""
        meta = AttentionMetadata(positions, slots, self.L, visible, kv_len)
        return self.drafter.step(self._drafter_ops(), hidden, tokens, meta, self.draft_cache)

    def draft_logprobs(self, hn: torch.Tensor) -> torch.Tensor:
        """Log q over the draft vocabulary ``[..., Vd]`` (processed like the target's logits when sampling)."""
        logits = self.drafter.logits(hn, self.ops)
        if not self.sampling.greedy:
            logits = process_logits(logits, self.sampling)
        return F.log_softmax(logits, dim=-1)

    # ================================================================== draft
    def draft(
        self, spec: SpecConfig | None = None, *, whole_cache: bool = False, timings: dict[str, float] | None = None
    ) -> DraftTree:
        """EAGLE-2 expansion from the last catch-up state, then global rerank (``tree.py``); a
        sampled chain instead for ``top_k=1`` at temperature > 0 (``SpecConfig.sample_chain_drafts``).
        ``spec``: the tree shape (default ``self.spec``)."""
        spec = spec or self.spec
        if self._sampled_chain(spec):
            return self._draft_sampled_chain(spec.num_draft_tokens - 1, whole_cache, timings)
        t0 = time.perf_counter()
        d, dev = self.drafter, self.device
        K, D, N = spec.top_k, spec.num_speculative_tokens, spec.num_draft_tokens
        B = self.L.shape[0]
        if K == 1 and N - 1 == D and self.observer is None and self.top1_chains:
            # a top-1 tree that keeps every candidate is the chain of each depth's top token: the same
            # drafter steps on the same inputs (so the same tokens, bit for bit) without the tree's
            # frontier bookkeeping (~0.3 ms of small ops a round on a CPU)
            node_tokens = torch.cat([self.root[:, None], self._top1_chain(D, whole_cache)], 1)
            return self._graft_lookup(spec, node_tokens, *self._chain_consts(B, N), whole_cache, timings, t0)
        if K > 1 and self.sampling.greedy and self.native_chains and self.observer is None:
            width = max((D - 1) * K, 1)
            out = d.native_tree(
                self.ops, self.hn, self.carry, self.L, self.active, self.root, self.draft_cache, K, D, N,
                self._kv_len(whole_cache, width),
            )  # fmt: skip
            if out is not None:  # the expansion below, as one native call
                return self._graft_lookup(spec, *out, whole_cache, timings, t0)
        lp = self.draft_logprobs(self.hn)  # [B, Vd]
        score, tk = lp.topk(K, dim=-1)  # [B, K] (ties over the vocabulary need no fixed order)
        tok = d.to_target_ids(tk)
        scores, tokens, parents = [score], [tok], [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        depths = [torch.ones(K, dtype=torch.int64, device=dev)]
        gid = torch.arange(K, device=dev).expand(B, K)  # candidate ids of the frontier
        hid = self.carry[:, None, :].expand(B, K, self.carry.shape[-1])
        width = max((D - 1) * K, 1)
        fmask = torch.zeros(B, K, width, dtype=torch.bool, device=dev)
        kv_len = self._kv_len(whole_cache, width)
        offset = K
        if self.observer is not None:
            self.observer.on_depth1(self.carry[:, None], self.active)
        for s in range(1, D):
            own = (s - 1) * K + torch.arange(K, device=dev)
            fmask = fmask.scatter(2, own.expand(B, K)[..., None], True)
            positions = (self.L + s - 1)[:, None].expand(B, K)
            slots = torch.where(self.active[:, None], self.L[:, None] + own, -1)  # idle rows write nowhere
            hn, carry = self.drafter_step(hid, tok, positions, slots, fmask, kv_len)
            if self.observer is not None:
                self.observer.on_step(s + 1, self.L, carry, self.active)
            lp = self.draft_logprobs(hn)  # [B, K, Vd]
            sk, tk = lp.topk(K, dim=-1)  # [B, K, K]
            cum = (score[:, :, None] + sk).reshape(B, K * K)
            ctok = d.to_target_ids(tk).reshape(B, K * K)
            scores.append(cum)
            tokens.append(ctok)
            parents.append(gid.repeat_interleave(K, dim=1))
            depths.append(torch.full((K * K,), s + 1, dtype=torch.int64, device=dev))
            if s == D - 1:
                break
            score, sel = topk_stable(cum, K)  # next frontier: best K of K^2
            up = sel // K
            tok = ctok.gather(1, sel)
            hid = carry.gather(1, up[..., None].expand(B, K, carry.shape[-1]))
            fmask = fmask.gather(1, up[..., None].expand(B, K, width))
            gid = offset + sel
            offset += K * K
        keep = rerank(torch.cat(scores, dim=1), N - 1)
        par, depth, mask = self._bookkeeping(
            cpu_tree.build_tree, build_tree, keep, torch.cat(parents, dim=1), torch.cat(depths), D
        )
        node_tokens = torch.cat([self.root[:, None], torch.cat(tokens, dim=1).gather(1, keep)], dim=1)
        return self._graft_lookup(spec, node_tokens, par, depth, mask, whole_cache, timings, t0)

    def _graft_lookup(
        self,
        spec: SpecConfig,
        node_tokens: torch.Tensor,  # [B, N]
        par: torch.Tensor,  # [B, N]
        depth: torch.Tensor,  # [B, N]
        mask: torch.Tensor,  # [B, N, N]
        whole_cache: bool,
        timings: dict[str, float] | None,
        t0: float,
    ) -> DraftTree:
        """The drafted tree with the prompt-lookup branch grafted on (``runtime/ngram.py``) when the
        spec asks for one."""
        N = spec.num_draft_tokens
        if spec.prompt_lookup_num_tokens:
            chain, valid = self.lookup(spec, whole_cache)
            node_tokens, par, depth, mask, added = self._bookkeeping(
                cpu_tree.graft_chain, graft_chain, node_tokens, par, depth, mask, chain, valid
            )
            if not whole_cache and self.device.type == "cpu":  # eager on the CPU: verify no padding nodes
                n = N + int(added.max())  # (a read, not a device sync; fixed shapes on GPUs and in compiled rounds)
                node_tokens, par, depth, mask = node_tokens[:, :n], par[:, :n], depth[:, :n], mask[:, :n, :n]
                self._cut_nodes = n - 1
        _add_time(timings, "draft", t0)
        return DraftTree(node_tokens, par, depth, mask, spec.tree_depth)

    def _sampled_chain(self, spec: SpecConfig) -> bool:
        """Whether ``draft`` draws a sampled chain (verified against q, without the lookup branch)."""
        return spec.top_k == 1 and spec.sample_chain_drafts and not self.sampling.greedy and not self.deterministic

    def take_draft_nodes(self) -> int:
        """Draft nodes per row the last round sent to verification (the root excluded): the shape's
        tree plus its lookup branch, or, after an eager CPU round that cut the lookup's padding nodes,
        the nodes it kept (read once: a replayed graph round runs no Python and never cuts)."""
        cut, self._cut_nodes = self._cut_nodes, None
        if cut is not None:
            return cut
        spec = self.spec
        return spec.num_draft_tokens - 1 + (0 if self._sampled_chain(spec) else spec.prompt_lookup_num_tokens)

    def lookup(self, spec: SpecConfig, whole_cache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt-lookup branch of each row (``runtime/ngram.py``): ``(tokens [B, M], valid
        [B, M])`` from the token history up to the root."""
        S = self._kv_len(whole_cache, 1)
        hist = self.bufs.hist[: self.rows]
        if S is not None:
            hist = hist[:, : min(S, hist.shape[1])]
        n = (spec.prompt_lookup_num_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        return self._bookkeeping(cpu_tree.ngram_lookup, ngram_lookup, hist, self.L, *n)

    def _bookkeeping(self, c_op: Callable, reference: Callable, *args):
        """``reference(*args)``, as ``kernels.cpu_tree``'s C operator ``c_op`` where it runs (eager CPU
        rounds with the CPU kernels on: one call instead of dozens of small ops, the same integers)."""
        out = c_op(*args) if self._cpu_index() else None
        return reference(*args) if out is None else out

    def _row_invariant_drafter(self) -> bool:
        """Whether a drafter forward gives each row the bits it gets in any row count: eager CPU rounds
        whose drafter layer's projections all run packed on the CPU kernel (``Eagle3Drafter.pack_for_cpu``; an
        unpacked weight may go to ``F.linear``, whose rows round by the row count) with the CPU norms and
        attention (the ``cpu_linear`` switch, float32/bfloat16)."""
        if not self._cpu_index() or self.drafter is None or self.target.dtype not in _cpu_linear.DTYPES:
            return False
        packed = self.drafter._cpu_weights(self.ops)  # the head is not part of a forward (logits run apart)
        return packed is not None and all(_cpu_linear.is_packed(w) for k, w in packed.items() if k != "head")

    def _cpu_index(self) -> bool:
        """Whether the ops run the round's index bookkeeping as ``kernels.cpu_tree``'s C operators on
        CPU tensors (``TorchOps.cpu_index``: where the CPU kernels run); they return None when they do
        not apply (CUDA, a traced round), and the references run."""
        return self.device.type == "cpu" and bool(getattr(self.ops, "cpu_index", False))

    def draft_chain(
        self,
        n: int,
        pick: Callable[[int, torch.Tensor], torch.Tensor],
        *,
        whole_cache: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Draft a chain of ``n`` tokens from the last catch-up state: at depth ``s+1`` the drafter's
        log q ``[B, Vd]`` is computed and ``pick(s, lp)`` chooses the token ``[B]`` (target ids) that
        the next drafter step is fed. Returns the picked tokens and the log q of every depth."""
        B = self.L.shape[0]
        lp = self.draft_logprobs(self.hn)  # [B, Vd] log q of depth 1
        hid = self.carry[:, None, :]  # [B, 1, H]
        width = max(n - 1, 1)
        kv_len = self._kv_len(whole_cache, width)
        fmask = torch.zeros(B, 1, width, dtype=torch.bool, device=self.device)
        col = torch.arange(width, device=self.device)
        toks, lps = [], []
        for s in range(n):
            tok = pick(s, lp)  # [B]
            toks.append(tok)
            lps.append(lp)
            if s == n - 1:
                break
            fmask = fmask | (col == s)  # the chain so far, this token included
            positions = (self.L + s)[:, None]
            slots = torch.where(self.active[:, None], positions, -1)  # idle rows write nowhere
            hn, hid = self.drafter_step(hid, tok[:, None], positions, slots, fmask, kv_len)
            lp = self.draft_logprobs(hn[:, 0])
        return toks, lps

    def _top1_chain(self, n: int, whole_cache: bool) -> torch.Tensor:  # [B, n] target ids
        """The tree's top-1 pick drafted as a chain of ``n``: greedy, in one native call where it runs
        (``Eagle3Drafter.native_chain``, ``native_chains``), else ``draft_chain``'s loop; the same tokens."""
        d = self.drafter
        if self.sampling.greedy and self.native_chains:
            kv_len = self._kv_len(whole_cache, max(n - 1, 1))  # draft_chain's bound for the chain's width
            chain = d.native_chain(self.ops, self.hn, self.carry, self.L, self.active, self.draft_cache, n, kv_len)
            if chain is not None:
                return chain
        pick = lambda s, lp: d.to_target_ids(lp.topk(1, dim=-1)[1][:, 0])  # noqa: E731  (the tree's top-1)
        return torch.stack(self.draft_chain(n, pick, whole_cache=whole_cache)[0], 1)

    def _draft_sampled_chain(self, n: int, whole_cache: bool, timings: dict[str, float] | None) -> DraftTree:
        """A chain of ``n`` tokens, each drawn from the drafter's processed distribution q by the
        exponential race; verified with min(1, p/q) (``kernels/verify_chain.py``)."""
        t0 = time.perf_counter()
        B = self.L.shape[0]
        Vd = self.drafter.config.draft_vocab_size
        _, xi = self.rng.draw(0, n * Vd, native=self._cpu_index())
        xi = xi.view(B, n, Vd)  # Exp(1) noise per depth
        d2t = self.d2t  # [Vd] target id of each draft id
        native = self._native_sampled_chain(n, whole_cache, xi)
        if native is not None:  # the loop below as one native call: the same tokens and q
            chain, q = native
        else:
            lxi = xi.log()  # [B, n, Vd], taken once (the native call takes it so too)
            toks, lps = self.draft_chain(n, lambda s, lp: d2t[(lp - lxi[:, s]).argmax(-1)], whole_cache=whole_cache)
            chain, lq = torch.stack(toks, 1), torch.stack(lps, 1)
            q = torch.zeros(B, n, self.target.vocab_size, device=self.device).index_add_(2, d2t, lq.exp())
        tree = self.chain_tree(torch.cat([self.root[:, None], chain], 1), draft_probs=q)
        _add_time(timings, "draft", t0)
        return tree

    def _native_sampled_chain(
        self, n: int, whole_cache: bool, xi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (target ids [B, n], q [B, n, V])
        """``_draft_sampled_chain``'s loop as one native call (``Eagle3Drafter.native_sampled_chain``) where it
        runs: eager CPU rounds with the native chains on, no observer, temperature-only processing (top-k and
        top-p run the Python loop)."""
        s = self.sampling
        if not self.native_chains or self.observer is not None or s.top_k or s.top_p < 1.0:
            return None
        kv_len = self._kv_len(whole_cache, max(n - 1, 1))  # draft_chain's bound for the chain's width
        return self.drafter.native_sampled_chain(
            self.ops,
            self.hn,
            self.carry,
            self.L,
            self.active,
            self.draft_cache,
            n,
            kv_len,
            xi,
            s.temperature,
            self.target.vocab_size,
        )

    def root_tree(self) -> DraftTree:
        """The tree of plain decoding: the root alone. Deterministic mode on probed ops (``pad_root``)
        appends a padding node (parent -1, never accepted) so that every op of the forward runs on the
        two rows from which a CPU's matmuls are row-invariant, instead of padding op by op
        (``runtime/deterministic.py``); on the CPU kernels, row-invariant at any count, it does not."""
        if not self.pad_root:
            return self.chain_tree(self.root[:, None])
        B = self.root.shape[0]
        c = self._chains.get((B, 0))
        if c is None:  # built once per row count, like the chains' constants
            par, depth, mask = self._chain_consts(B, 2)
            c = self._chains[B, 0] = (torch.full_like(par, -1), depth, mask)
        return DraftTree(self.root[:, None].repeat(1, 2), *c, 0)

    def chain_tree(self, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """The tree of a chain ``tokens [B, n+1]`` (root first); its parents/depths/mask are constants,
        built once per shape (the first, eager round of a graph key builds them before capture)."""
        B, N = tokens.shape
        return DraftTree(tokens, *self._chain_consts(B, N), N - 1, draft_probs=draft_probs)

    def _chain_consts(self, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(parents [B, N], depth [B, N], causal mask [B, N, N])`` of an N-node chain, built once."""
        c = self._chains.get((B, N))
        if c is None:
            ar = torch.arange(N, device=self.device)
            mask = torch.ones(N, N, dtype=torch.bool, device=self.device).tril()
            c = self._chains[B, N] = tuple(t.expand(B, *t.shape).contiguous() for t in (ar - 1, ar, mask))  # the
            #                                                                     Triton launchers take contiguous rows
        return c

    # ================================================================== verify
    def verify(
        self, tree: DraftTree, *, whole_cache: bool = False, timings: dict[str, float] | None = None
    ) -> Verification:
        """Target forward over the tree, then greedy or lossless sampling verification."""
        t0 = time.perf_counter()
        B, N = tree.tokens.shape
        positions = self.L[:, None] + tree.depth
        slots = torch.where(self.active[:, None], self.L[:, None] + torch.arange(N, device=self.device), -1)
        meta = AttentionMetadata(positions, slots, self.L, tree.mask, self._kv_len(whole_cache, N))
        hidden, aux = self.target.forward(self.ops, tree.tokens, meta, capture_aux=tree.max_depth > 0)
        finite = torch.isfinite(hidden).flatten(1).all(-1)  # [B], read on the host by collect (no sync here)
        if self.sampling.greedy:
            nodes, num, emitted = self.ops.verify_greedy(
                tree.tokens, tree.parents, self.target.greedy(hidden, self.ops), tree.max_depth
            )
        elif self.deterministic:  # the token after each node is its position's race winner: a greedy walk
            winners = position_race(
                process_logits(self.target.logits(hidden, self.ops), self.sampling), self.rng.key, positions + 1
            )
            nodes, num, emitted = self.ops.verify_greedy(tree.tokens, tree.parents, winners, tree.max_depth)
        else:
            logits = self.target.logits(hidden, self.ops)  # [B, N, V]
            probs = process_logits(logits, self.sampling).softmax(-1)
            uniforms, xi = self.rng.draw(N, logits.shape[-1], native=self._cpu_index())
            if tree.draft_probs is not None:  # a sampled chain: min(1, p/q)
                nodes, num, emitted = self.ops.verify_chain(tree.tokens, probs, tree.draft_probs, uniforms, xi)
            else:
                nodes, num, emitted = self.ops.verify_sampling(
                    tree.tokens, tree.parents, probs, uniforms, xi, tree.max_depth
                )
        _add_time(timings, "verify", t0)
        return Verification(nodes, num, emitted, aux, finite)

    # ================================================================== commit
    def commit(
        self, tree: DraftTree, v: Verification, *, whole_cache: bool = False, timings: dict[str, float] | None = None
    ) -> None:
        """Compact the accepted path's K/V, re-encode it in the drafter, advance L and the root, and
        write the emitted tokens and their count into ``out`` (all in place)."""
        t0 = time.perf_counter()
        B, N = tree.tokens.shape
        if tree.max_depth > 0:
            self.ops.kv_compact(
                self.target.k_cache, self.target.v_cache, self.L, torch.where(self.active[:, None], v.nodes, -1)
            )  # idle rows move nothing
        if self.speculative and not self._native_catch_up(tree, v, whole_cache):
            index = torch.where(v.nodes >= 0, torch.arange(B, device=self.device)[:, None] * N + v.nodes, -1)
            n_valid = torch.where(self.active, v.num + 1, 0)
            emitted = v.emitted
            if not whole_cache and self._row_invariant_drafter():  # re-encode only up to the longest accepted
                q = max(int(n_valid.max()), 1)  # path (a read, not a sync): the kernels compute each row alone,
                index, emitted = index[:, :q], emitted[:, :q]  # so the valid rows' bits do not change
            self._catch_up(
                v.aux.reshape(B * N, -1),
                index,
                emitted.clamp(min=0),
                n_valid,
                self.L,
                self._kv_len(whole_cache, tree.max_depth + 1),
            )
        counted = self.speculative and self._commit_history(v)  # the history (and drafted count) in one C call
        if self.speculative and not counted:  # the token history (prompt lookup): the root at L, the emitted after it
            hist = self.bufs.hist[: self.rows]
            pos = self.L[:, None] + torch.arange(v.emitted.shape[1] + 1, device=self.device)
            pos = pos.clamp(max=hist.shape[1] - 1)
            hist.scatter_(1, pos, torch.cat([self.root[:, None], v.emitted], 1))
        self.L.add_(torch.where(self.active, v.num + 1, 0))
        self.root.copy_(v.emitted.gather(1, v.num[:, None])[:, 0])
        w = v.emitted.shape[1]
        self.out[:, :w].copy_(v.emitted)
        w = max(w, self.emitted_width - 1)  # the count's column (a sampled chain may be shallower than the lookup)
        self.out[:, w].copy_(v.num if v.finite is None else torch.where(v.finite, v.num, -1))  # -1: not finite
        if self.track_drafted and self.speculative and not counted:  # adaptive shapes read it in collect
            n_tree = self.spec.num_draft_tokens  # nodes past it: the prompt-lookup branch (_graft_lookup)
            last = v.nodes.gather(1, v.num[:, None])[:, 0]  # [B] the deepest accepted node
            in_tree = ((v.nodes > 0) & (v.nodes < n_tree)).sum(1)  # [B] accepted drafter nodes
            self.out[:, -1].copy_(torch.where(last < n_tree, in_tree, -1))  # -1: the lookup branch went further
        _add_time(timings, "commit", t0)

    # ================================================================== round
    def round(
        self, *, whole_cache: bool = False, kv_cap: int | None = None, timings: dict[str, float] | None = None
    ) -> None:
        """One decode round on the static tensors: draft -> verify -> commit. No host
        synchronisation, fixed shapes (what a CUDA graph captures).

        ``whole_cache``: attend over the whole cache (a captured graph cannot know the lengths)
        instead of up to the host-known longest row, or up to ``kv_cap`` slots when given (a
        compiled round's ``kv_bucket``, part of its key); the visible slots, and so the math, are the same.
        """
        self._kv_cap = kv_cap
        try:
            tree = self.draft(whole_cache=whole_cache, timings=timings) if self.speculative else self.root_tree()
            v = self.verify(tree, whole_cache=whole_cache, timings=timings)
            self.commit(tree, v, whole_cache=whole_cache, timings=timings)
        finally:
            self._kv_cap = None


def not_finite(rows: list[int], phase: str, dtype: torch.dtype) -> UserError:
    """The error for NaN/inf target logits or hidden states (rows of the batch, the phase)."""
    return UserError(
        f"the target's logits are not finite (NaN or inf) for batch rows {rows} during {phase}: the weights "
        f"hold NaN/inf values or the activations overflow in {str(dtype).removeprefix('torch.')}; check the "
        "checkpoint, or run in float32 / bfloat16"
    )


def _add_time(timings: dict[str, float] | None, phase: str, t0: float) -> None:
    if timings is not None:
        timings[phase] += time.perf_counter() - t0
