"""``SpeculativeRuntime``: prefill, then rounds of draft -> verify -> commit.

One round, for a batch of B rows with committed target length ``L[b]`` and root token
``root[b]`` (emitted, not yet in the cache):

    draft   the drafter expands an EAGLE-2 tree from its last catch-up state (tree.py)
    verify  the target runs [root + N-1 nodes] at slots L..L+N-1 under the tree mask; greedy
            verification picks the longest matching path and the bonus token
    commit  the accepted path's K/V moves to slots L..L+a (kv_compact); the drafter re-encodes
            positions L..L+a with the target's true aux states (catch-up); L += a+1

Every step works on fixed-shape device tensors; the only host synchronisation is one read of
the emitted tokens at the end of each round (stop conditions). Plain decoding is the same
round with a tree that is only the root.

The round (``_round``) reads and writes only static buffers (``_Buffers``: lengths, roots,
drafter states, random keys/counters, the emitted-token row) and the caches, so on a CUDA device
it is captured once per batch-size bucket and replayed as a CUDA graph (``runtime/graphs.py``);
eager execution calls the very same ``_round``. Rows beyond the live batch (bucket padding,
finished rows) are idle: their writes go to the trash slot and their output is ignored.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from .profiles import tuned_spec
from .config import GenerationOutput, SpecConfig, SpecStats, StreamPiece
from .drafter import Eagle3Drafter
from .graphs import graph_runner
from .ops import get_ops, resolve_backend
from .sampling import RowRandom, SamplingParams, process_logits
from .target import TargetModel, default_aux_layer_ids
from .weights import load_tokenizer
from .tree import build_tree, rerank, topk_stable


@dataclass
class _Tree:
    tokens: torch.Tensor  # [B, N] node 0 = root
    parents: torch.Tensor  # [B, N]
    depth: torch.Tensor  # [B, N]
    mask: torch.Tensor  # [B, N, N] bool
    max_depth: int
    draft_probs: torch.Tensor | None = None  # [B, N-1, V] q of each node of a sampled chain (verify_chain)


class _Buffers:
    """Static decode state for ``max_batch_size`` rows; a round's tensors are views ``[:rows]``."""

    def __init__(self, max_batch: int, hidden: int | None, width: int, device: torch.device, dtype: torch.dtype):
        i64 = dict(dtype=torch.int64, device=device)
        self.L = torch.zeros(max_batch, **i64)  # [Bmax] committed target length (= drafter's encoded length)
        self.root = torch.zeros(max_batch, **i64)  # [Bmax] last emitted token
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=device)  # [Bmax]
        self.key = torch.zeros(max_batch, **i64)  # [Bmax] random key per request (sampling.RowRandom)
        self.counter = torch.zeros(max_batch, **i64)  # [Bmax] rounds drawn per request
        self.out = torch.zeros(max_batch, width, **i64)  # [Bmax, D+2] emitted tokens, then their count
        h = (max_batch, hidden) if hidden else (max_batch, 0)
        self.hn = torch.zeros(h, device=device, dtype=dtype)  # [Bmax, H] drafter normed hidden at L-1
        self.carry = torch.zeros(h, device=device, dtype=dtype)  # [Bmax, H] drafter carry at L-1

    def tensors(self) -> list[torch.Tensor]:
        return [self.L, self.root, self.active, self.key, self.counter, self.out, self.hn, self.carry]


@dataclass
class _State:
    bufs: _Buffers
    rows: int  # rows of the round's tensors: live rows plus idle padding up to a graph bucket
    L_host: list[int]
    active: list[bool]
    prompt_lens: list[int]
    outs: list[list[int]]
    reasons: list[str]
    sampling: SamplingParams
    rng: RowRandom | None
    drift_depth1: tuple | None = None  # (attention [B, Hq, 1, S], prefix lens) for drift diagnostics

    def __post_init__(self) -> None:
        self.narrow(self.rows)

    def narrow(self, rows: int) -> None:
        """Point the round's tensors at rows ``[:rows]`` of the static buffers."""
        b = self.bufs
        self.rows = rows
        self.L, self.root, self.active_t = b.L[:rows], b.root[:rows], b.active[:rows]  # [rows]
        self.hn_last, self.carry_last = b.hn[:rows], b.carry[:rows]  # [rows, H]
        self.out = b.out[:rows]  # [rows, D+2]
        if self.rng is not None:
            self.rng.key, self.rng.counter = b.key[:rows], b.counter[:rows]


class SpeculativeRuntime:
    """EAGLE-3/3.1 speculative decoding over a Llama-family target; lossless greedy output.

    Examples
    --------
    >>> import tritonspec as ts
    >>> rt = ts.SpeculativeRuntime.from_pretrained("target_dir", "drafter_dir")   # doctest: +SKIP
    >>> out = rt.generate("def fib(n):", max_new_tokens=32)                      # doctest: +SKIP
    >>> out.texts[0], out.stats.mean_acceptance_length                            # doctest: +SKIP
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Eagle3Drafter | None = None,
        tokenizer: Any = None,
        *,
        backend: str = "auto",
        spec: SpecConfig | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        cuda_graphs: str | bool = "auto",
        cuda_graph_sizes: Sequence[int] | None = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.device = target.device
        self.backend = resolve_backend(backend, self.device)
        self.ops = get_ops(self.backend)
        self.spec = spec or tuned_spec(target, drafter, self.backend) or SpecConfig()  # runtime/profiles.py
        if not isinstance(self.spec, SpecConfig):
            raise TypeError(f"spec must be a tritonspec.SpecConfig, got {type(self.spec).__name__}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.max_batch_size = max_batch_size
        self.cuda_graphs = cuda_graphs
        self._graphs = graph_runner(cuda_graphs, self.device, max_batch_size, cuda_graph_sizes)  # None = eager
        self._graph_cache_at: tuple[int, ...] | None = None  # addresses the captured graphs point at
        self._chains: dict[tuple[int, int], tuple] = {}  # (rows, nodes) -> chain parents, depths, mask
        limit = target.max_position_embeddings
        self.max_seq_len = max_seq_len if max_seq_len is not None else min(limit, 4096)
        if self.max_seq_len > limit:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the target's max_position_embeddings={limit}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 2")
        window = getattr(target.config, "sliding_window", None)
        uses_window = getattr(target.config, "use_sliding_window", target.arch == "mistral")
        if window is not None and uses_window and window < self.max_seq_len:
            raise ValueError(f"the target uses sliding-window attention (window {window}), which is not supported; "
                             f"pass max_seq_len <= {window}")
        self.drafter = drafter
        self.drift = None  # a runtime.drift.DriftRecorder while measuring attention drift
        if drafter is not None:
            self._attach_drafter(drafter)
        K, D, N = self.spec.top_k, self.spec.num_speculative_tokens, self.spec.num_draft_tokens
        target.allocate_cache(max_batch_size, self.max_seq_len + N)
        if drafter is not None:
            self.drafter_capacity = self.max_seq_len + max((D - 1) * K, D + 1)
            shape = (max_batch_size, self.drafter_capacity + 1, drafter.config.num_key_value_heads, drafter.config.head_dim)
            self.dk = torch.zeros(shape, device=self.device, dtype=target.dtype)
            self.dv = torch.zeros(shape, device=self.device, dtype=target.dtype)
            drafter.rope(self.drafter_capacity + 1)
        self._bufs = self._new_buffers()

    def _new_buffers(self) -> _Buffers:
        hidden = self.drafter.config.hidden_size if self.drafter is not None else None
        return _Buffers(self.max_batch_size, hidden, self.spec.num_speculative_tokens + 2, self.device,
                        self.target.dtype)

    def warmup(self, batch_sizes: Sequence[int] | None = None, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, speculative: bool = True) -> list[int]:
        """Capture the decode-round graphs now instead of on first use (CUDA only; a no-op eager).

        Runs a short dummy generation per batch-size bucket with these sampling settings (graphs
        are keyed by bucket, tree shape and sampling settings). Returns the buckets captured.

        Examples
        --------
        >>> rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cuda")   # doctest: +SKIP
        >>> rt.warmup()                                                       # doctest: +SKIP
        [1, 2, 4, 8]
        """
        if self._graphs is None:
            return []
        sizes = self._graphs.sizes if batch_sizes is None else sorted({int(b) for b in batch_sizes})
        for b in sizes:
            if not 1 <= b <= self.max_batch_size:
                raise ValueError(f"warmup batch size {b} must lie in [1, max_batch_size={self.max_batch_size}]")
            self.generate([[0]] * b, max_new_tokens=2, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=0, stop_token_ids=(), speculative=speculative and self.drafter is not None)
        captured = {k[0] for k in self._graphs.graphs}
        return sorted({self._graphs.bucket(b) for b in sizes} & captured)

    def _attach_drafter(self, d: Eagle3Drafter) -> None:
        t, c = self.target, d.config
        if c.vocab_size != t.vocab_size:
            raise ValueError(f"drafter vocab_size={c.vocab_size} does not match the target's vocab_size={t.vocab_size}")
        if c.target_hidden_size != t.hidden_size:
            raise ValueError(f"drafter target_hidden_size={c.target_hidden_size} does not match the target's "
                             f"hidden_size={t.hidden_size}")
        ids = c.aux_layer_ids
        if ids is None:
            ids = default_aux_layer_ids(t.num_layers)
            warnings.warn(f"the drafter records no aux layer ids; using EAGLE-3's default boundaries {ids}", stacklevel=3)
            c.aux_layer_ids = ids
        if len(ids) != c.num_aux_hidden_states:
            raise ValueError(f"drafter expects {c.num_aux_hidden_states} aux states but lists aux layer ids {list(ids)}")
        self.aux_layer_ids = tuple(ids)
        t.set_aux_layer_ids(ids)
        if self.spec.top_k > c.draft_vocab_size:
            raise ValueError(f"top_k={self.spec.top_k} exceeds the drafter's draft_vocab_size={c.draft_vocab_size}")
        d.to(device=self.device, dtype=t.dtype)
        d.eval()
        d.attach_target_embedding(t.embed, t.drafter_info())
        self.d2t_all = d.target_ids()  # [Vd] target ids, for the sampled chain

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | Any,
        drafter: str | Path | Eagle3Drafter | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        backend: str = "auto",
        spec: SpecConfig | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        cuda_graphs: str | bool = "auto",
        cuda_graph_sizes: Sequence[int] | None = None,
        tokenizer: Any = None,
    ) -> "SpeculativeRuntime":
        """Build a runtime from a target (HF directory or ``PreTrainedModel``) and an optional drafter.

        Parameters
        ----------
        target : Hugging Face model directory, or a loaded transformers ``PreTrainedModel``.
        drafter : drafter directory, an ``Eagle3Drafter``, or None (plain decoding only).
        device, dtype : where and in which precision to run (CPU default: float32).
        backend : ``"auto"`` (Triton on CUDA, else torch), ``"torch"`` or ``"triton"``.
        spec : draft-tree shape; None = the tuned profile for this pair/device (``tritonspec autotune
            tree``) when there is one, else ``SpecConfig()`` defaults.
        max_batch_size, max_seq_len : static cache sizes (max_seq_len = prompt + generated).
        cuda_graphs : ``"auto"`` (capture decode rounds as CUDA graphs on a CUDA device), ``True``
            (the same; warns and runs eager without CUDA) or ``False`` (always eager, vLLM's
            ``enforce_eager``). Capture failures warn and fall back to eager.
        cuda_graph_sizes : batch-size buckets to capture (default 1, 2, 4, ... up to
            ``max_batch_size``); a batch is padded up to the next bucket, larger ones run eager.
        tokenizer : optional; by default read from the target directory when it has one.
        """
        tm = TargetModel.from_pretrained(target, device=device, dtype=dtype)
        d = drafter
        if isinstance(drafter, (str, Path)):
            d = Eagle3Drafter.from_pretrained(drafter)
        elif drafter is not None and not isinstance(drafter, Eagle3Drafter):
            raise TypeError(f"drafter must be a directory or an Eagle3Drafter, got {type(drafter).__name__}")
        if tokenizer is None and isinstance(target, (str, Path)):
            tokenizer = load_tokenizer(Path(target))
        return cls(tm, d, tokenizer, backend=backend, spec=spec, max_batch_size=max_batch_size,
                   max_seq_len=max_seq_len, cuda_graphs=cuda_graphs, cuda_graph_sizes=cuda_graph_sizes)

    # ================================================================== public API
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        speculative: bool = True,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per prompt, exactly as the target alone would.

        Greedy (``temperature=0``) output equals the target's greedy decoding; with
        ``temperature > 0`` the output has exactly the target's (processed) distribution.
        ``seed``: one int for every prompt, or one per prompt; the same seed gives the same output.
        ``stop``: stop strings (the text is cut before them, the tokens end with the one that
        completed them). ``token_ids`` include a stop token that ended the row.
        ``speculative=False`` runs plain target decoding through the same runtime (the baseline).
        """
        run = self._start(prompts, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, speculative, stop)
        for _ in run:
            pass
        return run.result

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        speculative: bool = True,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[StreamPiece]:
        """Yield text pieces of one prompt as they are decided; the last piece carries the stats.

        Pieces never split a multi-byte character and never show text that a stop string may
        still remove, so ``"".join(p.text for p in rt.stream(...))`` equals ``generate``'s text.

        Examples
        --------
        >>> for piece in rt.stream("def f(x):", max_new_tokens=32):   # doctest: +SKIP
        ...     print(piece.text, end="", flush=True)
        """
        if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
            raise ValueError("stream() takes one prompt (a string or a token id list); use generate() for batches")
        run = self._start([prompt] if isinstance(prompt, str) else [list(prompt)], max_new_tokens, temperature,
                          top_p, top_k, seed, stop_token_ids, speculative, stop)
        sent, n_tok = 0, 0
        hold = max((len(x) for x in run.sampling.stop), default=1) - 1
        for st in run:
            toks = st.outs[0]
            done = not st.active[0]
            text = self._text(toks, run.sampling) if self.tokenizer is not None else ""
            if not done:
                text = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its bytes
                text = text[: max(sent, len(text) - hold)]
            if len(text) > sent or len(toks) > n_tok:
                yield StreamPiece(text=text[sent:], token_ids=toks[n_tok:])
                sent, n_tok = max(sent, len(text)), len(toks)
        out = run.result
        final = out.texts[0] if out.texts is not None else ""
        yield StreamPiece(text=final[sent:], token_ids=[], finish_reason=out.finish_reasons[0], stats=out.stats)

    def _start(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, speculative, stop):
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), stop=stops)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: load a target directory that has one or pass tokenizer=")
        batch = self._encode(prompts)
        seeds = self._seeds(seed, len(batch), sampling)
        use_draft = speculative and self.drafter is not None
        if speculative and self.drafter is None:
            warnings.warn("no drafter loaded: speculative=True runs plain decoding", stacklevel=3)
        return _Run(self._rounds(batch, max_new_tokens, sampling, seeds, self._stop_ids(stop_token_ids), use_draft),
                    sampling)

    def _rounds(self, batch, max_new_tokens, sampling, seeds, stops, use_draft) -> Iterator[_State]:
        """The decode loop: prefill, then draft -> verify -> commit until every row has stopped.
        Yields the state after the prefill and after each round; returns the output."""
        stats = SpecStats(accepted_per_position=[0] * self.spec.num_speculative_tokens if use_draft else [])
        t0 = time.perf_counter()
        if use_draft:  # runtimes may share one TargetModel (e.g. EAGLE-3 and 3.1 drafters side by side)
            self.target.set_aux_layer_ids(self.aux_layer_ids)
        width = (self.spec.num_speculative_tokens if use_draft else 0) + 2  # emitted tokens + their count
        if self._bufs.out.shape[1] < width:  # the tree depth grew since construction (autotune)
            self._bufs = self._new_buffers()
            if self._graphs is not None:
                self._graphs.reset()
        n = len(batch)
        # runtimes may share the target, whose cache only grows: make sure it fits this one
        self.target.allocate_cache(self.max_batch_size, self.max_seq_len + self.spec.num_draft_tokens)
        with torch.inference_mode():  # never across a yield: the caller's code runs between rounds
            st = self._prefill(batch, use_draft, sampling, seeds, stats, rows=self._rows(n))
            first = st.root[:n].tolist()
        self._emit(st, [[r] for r in first], stops, max_new_tokens, advance=False)
        yield st
        n_draft = self.spec.num_draft_tokens - 1
        while any(st.active):
            live = max(b for b, a in enumerate(st.active) if a) + 1
            if self._rows(live) < st.rows:  # finished rows at the end: a smaller bucket does
                st.narrow(self._rows(live))
            with torch.inference_mode():
                self._run_round(st, use_draft, stats)
                em = st.out[:, :width].tolist()  # the round's one host sync
            nm = [row[width - 1] for row in em]
            new = [row[: k + 1] if a else [] for row, k, a in zip(em, nm, st.active)]
            if use_draft:
                self._count(stats, nm, st.active, n_draft)
            self._emit(st, new, stops, max_new_tokens)
            yield st
        stats.wall_time_s = time.perf_counter() - t0
        outs, reasons = st.outs[:n], st.reasons[:n]  # drop bucket padding
        stats.num_new_tokens = sum(len(o) for o in outs)
        texts = None
        if self.tokenizer is not None:
            texts = [self._text(o, sampling) for o in outs]
        return GenerationOutput(token_ids=outs, texts=texts, stats=stats, finish_reasons=reasons)

    def _graph_addresses(self) -> tuple[int, ...]:
        """Addresses of the tensors a captured round reads that something outside this runtime can
        replace: the target's cache and rope tables (the cache grows for a runtime sharing the target),
        the drafter's rope tables and weights (another runtime may grow or move them)."""
        t = self.target
        ts_ = [t.k_cache, t.v_cache, t.rope.cos, t.rope.sin]
        if self.drafter is not None:
            r = self.drafter.rope()
            ts_ += [r.cos, r.sin, *self.drafter.parameters()]
        return tuple(x.data_ptr() for x in ts_)

    def _rows(self, live: int) -> int:
        """Rows a round runs on: ``live`` (eager) or its graph bucket (live rows only ever decrease,
        so the bucket never exceeds the batch's own)."""
        if self._graphs is None or self.drift is not None:
            return live
        b = self._graphs.bucket(live)
        return live if b is None else b

    def _run_round(self, st: _State, use_draft: bool, stats: SpecStats) -> None:
        """Replay (or capture) the round's graph for this bucket, or run it eagerly."""
        g = self._graphs
        if g is not None and self.drift is None:
            where = self._graph_addresses()
            if where != self._graph_cache_at:  # e.g. another runtime grew the shared cache: graphs point at the old one
                g.reset()
                self._graph_cache_at = where
            sp = st.sampling
            key = (st.rows, use_draft, self.spec, sp.temperature, sp.top_p, sp.top_k)
            t0 = time.perf_counter()
            if g.run(key, lambda: self._round(st, use_draft, None, whole_cache=True), self._bufs.tensors()):
                stats.time_split_s["graph"] = stats.time_split_s.get("graph", 0.0) + time.perf_counter() - t0
                return
        self._round(st, use_draft, stats)

    def _round(self, st: _State, use_draft: bool, stats: SpecStats | None, whole_cache: bool = False) -> None:
        """One decode round on the state's static tensors: draft -> verify -> commit, then the
        emitted tokens and their count into ``st.out``. No host synchronisation, fixed shapes.

        ``whole_cache``: attend over the whole cache (a captured graph cannot know the lengths)
        instead of up to the host-known longest row; the visible slots, and so the math, are the same.
        """
        tree = self._draft(st, stats, whole_cache) if use_draft else self._root_only(st)
        nodes, num, emitted, aux = self._verify(st, tree, stats, whole_cache)
        self._commit(st, tree, nodes, num, emitted, aux, use_draft, stats, whole_cache)
        w = emitted.shape[1]
        st.out[:, :w].copy_(emitted)
        st.out[:, w].copy_(num)

    def _text(self, tokens: list[int], sampling: SamplingParams) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in sampling.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    @staticmethod
    def _seeds(seed, batch: int, sampling: SamplingParams) -> list[int]:
        if seed is None:
            return torch.randint(0, 2**62, (batch,)).tolist() if not sampling.greedy else [0] * batch
        if isinstance(seed, int):
            return [seed] * batch
        seeds = [int(s) for s in seed]
        if len(seeds) != batch:
            raise ValueError(f"{len(seeds)} seeds for {batch} prompts: pass one int or one seed per prompt")
        return seeds

    # ================================================================== input handling
    def _encode(self, prompts: Any) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and all(isinstance(x, int) for x in prompts):
            prompts = [list(prompts)]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts is empty: pass a string, a list of strings, or token id lists")
        batch: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer: load a target directory that has one, "
                                     "pass tokenizer=..., or pass token ids")
                ids = list(self.tokenizer(p, add_special_tokens=True)["input_ids"])
            else:
                ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.target.vocab_size}): {bad[:5]}")
            if len(ids) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens but max_seq_len={self.max_seq_len} "
                                 "(prompt + generated tokens); shorten it or raise max_seq_len")
            batch.append(ids)
        if len(batch) > self.max_batch_size:
            raise ValueError(f"{len(batch)} prompts exceed max_batch_size={self.max_batch_size}; "
                             "split the batch or raise max_batch_size")
        return batch

    def _stop_ids(self, stop_token_ids: Iterable[int] | None) -> set[int]:
        if stop_token_ids is not None:
            return {int(t) for t in stop_token_ids}
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(self.target.config, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    # ================================================================== round steps
    def _prefill(self, batch: list[list[int]], use_draft: bool, sampling: SamplingParams, seeds: list[int],
                 stats: SpecStats, rows: int | None = None) -> _State:
        """Run the prompts, pick the first token, encode the drafter; ``rows - len(batch)`` idle rows pad
        the state up to a graph bucket."""
        t0 = time.perf_counter()
        B, P = len(batch), max(len(p) for p in batch)
        rows = B if rows is None else rows
        dev = self.device
        lens = torch.tensor([len(p) for p in batch], device=dev)
        tokens = torch.zeros(B, P, dtype=torch.int64, device=dev)
        for b, p in enumerate(batch):
            tokens[b, : len(p)] = torch.tensor(p, device=dev)
        ar = torch.arange(P, device=dev)
        valid = ar[None, :] < lens[:, None]
        positions = ar.expand(B, P)
        slots = torch.where(valid, positions, -1)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril().expand(B, P, P)
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        hidden, aux = self.target.forward(self.ops, tokens, positions, slots, zero, causal, P, capture_aux=use_draft,
                                          prefill=True)
        last = (lens - 1)[:, None]
        h_last = hidden.gather(1, last[..., None].expand(B, 1, hidden.shape[-1]))[:, 0]
        pad = rows - B
        bufs = self._bufs
        for t in bufs.tensors():
            t[:rows].zero_()
        rng = None
        if not sampling.greedy:
            rng = RowRandom(list(seeds) + [0] * pad, dev, key=bufs.key[:rows], counter=bufs.counter[:rows])
        st = _State(bufs=bufs, rows=rows, L_host=[len(p) for p in batch] + [0] * pad, active=[True] * B + [False] * pad,
                    prompt_lens=[len(p) for p in batch] + [0] * pad, outs=[[] for _ in range(rows)],
                    reasons=["length"] * rows, sampling=sampling, rng=rng)
        logits = self.target.logits(h_last)
        if sampling.greedy:
            root = logits.argmax(-1)
        else:  # the first token: an exponential-race sample of the processed distribution
            _, xi = rng.draw(1, logits.shape[-1])
            root = (process_logits(logits, sampling).log_softmax(-1) - xi[:B].log()).argmax(-1)
        st.L[:B].copy_(lens)
        st.root[:B].copy_(root)
        st.active_t[:B].fill_(True)
        if use_draft:
            nxt = torch.cat([tokens[:, 1:], torch.zeros(B, 1, dtype=torch.int64, device=dev)], dim=1)
            nxt = nxt.scatter(1, last, root[:, None])  # pair (g_t, x_{t+1}); x_P = root
            index = torch.where(valid, torch.arange(B, device=dev)[:, None] * P + ar, -1)
            self._catch_up(st, aux.reshape(B * P, -1), index, nxt, lens, zero, P, prefill=True)
        stats.time_split_s["prefill"] += time.perf_counter() - t0
        return st

    def _catch_up(self, st: _State, aux_flat: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor,
                  n_valid: torch.Tensor, start: torch.Tensor, kv_len: int | None, prefill: bool = False) -> None:
        """Drafter re-encodes ``n_valid`` positions from ``start`` with true target features; the
        state's first ``B`` rows get the drafter's state at the last one (B = rows of ``index``)."""
        d = self.drafter
        B, Qc = index.shape
        ar = torch.arange(Qc, device=self.device)
        g = d.combine(self.ops, aux_flat, index.reshape(-1)).view(B, Qc, -1)
        positions = start[:, None] + ar
        slots = torch.where(ar[None, :] < n_valid[:, None], positions, -1)
        if prefill:  # Qc = the prompt length: not a shape worth keeping
            causal = torch.ones(Qc, Qc, dtype=torch.bool, device=self.device).tril().expand(B, Qc, Qc)
        else:  # a decode round: Qc = max depth + 1, the chain's constant mask
            causal = self._chain_consts(B, Qc)[2]
        hn, carry = d.step(self.ops, g, tokens, positions, self.dk, self.dv, slots, start, causal, kv_len, prefill=prefill)
        last = (n_valid - 1).clamp(min=0)[:, None, None].expand(B, 1, hn.shape[-1])
        st.hn_last[:B].copy_(hn.gather(1, last)[:, 0])
        st.carry_last[:B].copy_(carry.gather(1, last)[:, 0])
        if self.drift is not None:  # depth 1 of the next round is this catch-up's last position
            attn = d.last_attention  # [B, Hq, Qc, S]
            idx = last[:, :1, :1].reshape(B, 1, 1, 1).expand(B, attn.shape[1], 1, attn.shape[-1])
            st.drift_depth1 = (attn.gather(2, idx), start + n_valid)

    def _draft(self, st: _State, stats: SpecStats | None, whole_cache: bool = False) -> _Tree:
        """EAGLE-2 expansion from the last catch-up state, then global rerank (tree.py); a sampled
        chain instead for ``top_k=1`` at temperature > 0 (``SpecConfig.sample_chain_drafts``)."""
        if self.spec.top_k == 1 and self.spec.sample_chain_drafts and not st.sampling.greedy:
            return self._draft_sampled_chain(st, stats, whole_cache)
        t0 = time.perf_counter()
        d, dev = self.drafter, self.device
        K, D, N = self.spec.top_k, self.spec.num_speculative_tokens, self.spec.num_draft_tokens
        B = st.L.shape[0]
        lp = self._draft_logprobs(st, st.hn_last)  # [B, Vd]
        score, tk = lp.topk(K, dim=-1)  # [B, K] (ties over the vocabulary need no fixed order)
        tok = d.to_target_ids(tk)
        scores, tokens, parents = [score], [tok], [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        depths = [torch.ones(K, dtype=torch.int64, device=dev)]
        gid = torch.arange(K, device=dev).expand(B, K)  # candidate ids of the frontier
        hid = st.carry_last[:, None, :].expand(B, K, st.carry_last.shape[-1])
        width = max((D - 1) * K, 1)
        fmask = torch.zeros(B, K, width, dtype=torch.bool, device=dev)
        kv_len = None if whole_cache else max(st.L_host) + width
        offset = K
        if self.drift is not None:
            attn1, prefix1 = st.drift_depth1
            self.drift.observe(1, attn1, prefix1, st.carry_last[:, None], st.active_t)
        for s in range(1, D):
            own = (s - 1) * K + torch.arange(K, device=dev)
            fmask = fmask.scatter(2, own.expand(B, K)[..., None], True)
            positions = (st.L + s - 1)[:, None].expand(B, K)
            slots = torch.where(st.active_t[:, None], st.L[:, None] + own, -1)  # idle rows write nowhere
            hn, carry = d.step(self.ops, hid, tok, positions, self.dk, self.dv, slots, st.L, fmask, kv_len)
            if self.drift is not None:
                self.drift.observe(s + 1, d.last_attention, st.L, carry, st.active_t)
            lp = self._draft_logprobs(st, hn)  # [B, K, Vd]
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
        par, depth, mask = build_tree(keep, torch.cat(parents, dim=1), torch.cat(depths), D)
        node_tokens = torch.cat([st.root[:, None], torch.cat(tokens, dim=1).gather(1, keep)], dim=1)
        _add_time(stats, "draft", t0)
        return _Tree(node_tokens, par, depth, mask, D)

    def _draft_sampled_chain(self, st: _State, stats: SpecStats | None, whole_cache: bool = False) -> _Tree:
        """A chain of ``n = num_draft_tokens - 1`` tokens, each drawn from the drafter's processed
        distribution q by the exponential race; verified with min(1, p/q) (kernels/verify_chain.py)."""
        t0 = time.perf_counter()
        d, dev = self.drafter, self.device
        n = self.spec.num_draft_tokens - 1
        B = st.L.shape[0]
        Vd = d.config.draft_vocab_size
        _, xi = st.rng.draw(0, n * Vd)
        xi = xi.view(B, n, Vd)  # Exp(1) noise per depth
        d2t = self.d2t_all  # [Vd] target id of each draft id
        lp = self._draft_logprobs(st, st.hn_last)  # [B, Vd] log q of depth 1
        hid = st.carry_last[:, None, :]  # [B, 1, H]
        width = max(n - 1, 1)
        kv_len = None if whole_cache else max(st.L_host) + width
        fmask = torch.zeros(B, 1, width, dtype=torch.bool, device=dev)
        col = torch.arange(width, device=dev)
        toks, qs = [], []
        for s in range(n):
            tok = d2t[(lp - xi[:, s].log()).argmax(-1)]  # [B] a sample of q
            toks.append(tok)
            qs.append(lp.exp())
            if s == n - 1:
                break
            fmask = fmask | (col == s)  # the chain so far, this token included
            positions = (st.L + s)[:, None]
            slots = torch.where(st.active_t[:, None], positions, -1)  # idle rows write nowhere
            hn, hid = d.step(self.ops, hid, tok[:, None], positions, self.dk, self.dv, slots, st.L, fmask, kv_len)
            lp = self._draft_logprobs(st, hn[:, 0])
        q = torch.zeros(B, n, self.target.vocab_size, device=dev).index_add_(2, d2t, torch.stack(qs, 1))
        tree = self._chain(torch.cat([st.root[:, None], torch.stack(toks, 1)], 1), draft_probs=q)
        _add_time(stats, "draft", t0)
        return tree

    def _draft_logprobs(self, st: _State, hn: torch.Tensor) -> torch.Tensor:
        logits = self.drafter.logits(hn)
        if not st.sampling.greedy:
            logits = process_logits(logits, st.sampling)
        return F.log_softmax(logits, dim=-1)

    def _root_only(self, st: _State) -> _Tree:
        return self._chain(st.root[:, None])

    def _chain(self, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> _Tree:
        """The tree of a chain ``tokens [B, n+1]`` (root first); its parents/depths/mask are constants,
        built once per shape (the first, eager round of a graph key builds them before capture)."""
        B, N = tokens.shape
        return _Tree(tokens, *self._chain_consts(B, N), N - 1, draft_probs=draft_probs)

    def _chain_consts(self, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(parents [B, N], depth [B, N], causal mask [B, N, N])`` of an N-node chain, built once."""
        c = self._chains.get((B, N))
        if c is None:
            ar = torch.arange(N, device=self.device)
            mask = torch.ones(N, N, dtype=torch.bool, device=self.device).tril()
            c = self._chains[B, N] = tuple(t.expand(B, *t.shape).contiguous() for t in (ar - 1, ar, mask))  # the
            #                                                                     Triton launchers take contiguous rows
        return c

    def _verify(self, st: _State, tree: _Tree, stats: SpecStats | None, whole_cache: bool = False):
        """Target forward over the tree, then greedy verification."""
        t0 = time.perf_counter()
        B, N = tree.tokens.shape
        positions = st.L[:, None] + tree.depth
        slots = torch.where(st.active_t[:, None], st.L[:, None] + torch.arange(N, device=self.device), -1)
        hidden, aux = self.target.forward(self.ops, tree.tokens, positions, slots, st.L, tree.mask,
                                          None if whole_cache else max(st.L_host) + N, capture_aux=tree.max_depth > 0)
        if st.sampling.greedy:
            nodes, num, emitted = self.ops.verify_greedy(tree.tokens, tree.parents, self.target.greedy(hidden),
                                                         tree.max_depth)
        else:
            logits = self.target.logits(hidden)  # [B, N, V]
            probs = process_logits(logits, st.sampling).softmax(-1)
            uniforms, xi = st.rng.draw(N, logits.shape[-1])
            if tree.draft_probs is not None:  # a sampled chain: min(1, p/q)
                nodes, num, emitted = self.ops.verify_chain(tree.tokens, probs, tree.draft_probs, uniforms, xi)
            else:
                nodes, num, emitted = self.ops.verify_sampling(tree.tokens, tree.parents, probs, uniforms, xi,
                                                               tree.max_depth)
        _add_time(stats, "verify", t0)
        return nodes, num, emitted, aux

    def _commit(self, st: _State, tree: _Tree, nodes: torch.Tensor, num: torch.Tensor, emitted: torch.Tensor,
                aux: torch.Tensor | None, use_draft: bool, stats: SpecStats | None, whole_cache: bool = False) -> None:
        """Compact the accepted path's K/V, re-encode it in the drafter, advance L and the root (in place)."""
        t0 = time.perf_counter()
        B, N = tree.tokens.shape
        if tree.max_depth > 0:
            self.ops.kv_compact(self.target.k_cache, self.target.v_cache, st.L,
                                torch.where(st.active_t[:, None], nodes, -1))  # idle rows move nothing
        if use_draft:
            index = torch.where(nodes >= 0, torch.arange(B, device=self.device)[:, None] * N + nodes, -1)
            self._catch_up(st, aux.reshape(B * N, -1), index, emitted.clamp(min=0),
                           torch.where(st.active_t, num + 1, 0), st.L,
                           None if whole_cache else max(st.L_host) + tree.max_depth + 1)
        st.L.add_(torch.where(st.active_t, num + 1, 0))
        st.root.copy_(emitted.gather(1, num[:, None])[:, 0])
        _add_time(stats, "commit", t0)

    # ================================================================== host bookkeeping
    def _emit(self, st: _State, new: list[list[int]], stops: set[int], max_new_tokens: int,
              advance: bool = True) -> None:
        """Append each active row's new tokens, honouring stop tokens, stop strings, max_new_tokens
        and max_seq_len; tokens decided past a stop are dropped."""
        was = list(st.active)
        for b, toks in enumerate(new):
            if not st.active[b]:
                continue
            if advance:
                st.L_host[b] += len(toks)
            out = st.outs[b]
            for t in toks:
                out.append(t)
                if t in stops or (st.sampling.stop and self._hits_stop_string(out, st.sampling)):
                    st.reasons[b] = "stop"
                    st.active[b] = False
                    break
                if len(out) >= max_new_tokens or st.prompt_lens[b] + len(out) >= self.max_seq_len:
                    st.active[b] = False
                    break
            if not st.active[b]:  # a finished row idles at L=0 so that it never writes past its cache
                st.L_host[b] = 0
        stopped = [b for b, a in enumerate(st.active) if was[b] and not a and b < st.rows]
        if stopped:  # a host-side list: no device read
            idx = torch.tensor(stopped, device=self.device)
            st.L.index_fill_(0, idx, 0)
            st.active_t.index_fill_(0, idx, False)

    def _hits_stop_string(self, out: list[int], sampling: SamplingParams) -> bool:
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return any(s in text for s in sampling.stop)

    @staticmethod
    def _count(stats: SpecStats, num: list[int], active: list[bool], n_draft: int) -> None:
        for n, a in zip(num, active):
            if not a:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += n_draft
            stats.num_accepted_tokens += n
            for i in range(n):
                stats.accepted_per_position[i] += 1


def _add_time(stats: SpecStats | None, phase: str, t0: float) -> None:
    if stats is not None:
        stats.time_split_s[phase] += time.perf_counter() - t0


class _Run:
    """Iterates a decode loop (yielding its state after each round) and keeps its return value."""

    def __init__(self, gen: Iterator[_State], sampling: SamplingParams):
        self.gen, self.sampling, self.result = gen, sampling, None

    def __iter__(self) -> Iterator[_State]:
        self.result = yield from self.gen
