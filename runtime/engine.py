"""``SpeculativeRuntime``: the public façade over one target (+ an optional drafter).

It builds and validates the pair, owns a ``Decoder`` (``runtime/decode.py``: the decode state
and the round's prefill / draft / verify / commit steps), and runs the decode loop behind
``generate`` and ``stream``: prefill, then rounds until every row has stopped, each round either
replayed as a CUDA graph (``runtime/graphs.py``, one per batch-size bucket) or run eagerly.
Request handling on the host (prompt encoding, seeds, stop ids and strings, outputs) lives in
``runtime/requests.py``.

The round reads and writes only the decoder's static buffers and the caches, so on a CUDA device
it is captured once per bucket and replayed; eager execution calls the very same function. Rows
beyond the live batch (bucket padding, finished rows) are idle: their writes go to the trash slot
and their output is ignored. The only host synchronisation of a round is ``Decoder.collect``.

One request at a time per target: the decode state and the target's KV cache are shared by every
request of a runtime (and by runtimes sharing a ``TargetModel``), so the target's
``decode_lock`` (a ``target.DecodeLock``) serialises them. A ``generate`` or ``stream`` from
another thread waits until the running request ends (a stream ends when it is exhausted or
closed); a ``generate`` or ``stream`` started in the thread
that holds an open stream would wait forever, and raises a ``UserError`` instead. Never wrong tokens.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..kernels.cpu_linear import MODES as CPU_LINEAR_MODES
from ..kernels.cpu_linear import available as cpu_kernel_unavailable
from .adaptive import ShapeTracker
from .config import GenerationOutput, SpecConfig, SpecStats, StreamPiece
from .decode import Decoder, DraftObserver
from .deterministic import DeterministicOps
from .drafter import Eagle3Drafter
from .errors import UserError
from .gguf import resolve_target
from .graphs import graph_runner
from .ops import get_ops, resolve_backend
from .profiles import shape_policy
from .requests import (
    RequestRows,
    as_float,
    as_int,
    encode_prompts,
    is_chat,
    one_prompt,
    resolve_stop_ids,
    row_budgets,
    row_seeds,
)
from .sampling import SamplingParams
from .spec_policy import ShapeChoice, ShapePolicy, prompt_pass_pays, prompt_pass_ratio
from .target import TargetModel, default_aux_layer_ids, resolve_layout
from .weights import load_tokenizer

# SpeculativeRuntime's default drafter_weight_dtype (_check_drafter_weight_dtype): bfloat16 drafter weights
# where they apply
DRAFTER_WEIGHT_DTYPE = "auto"


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
        deterministic: bool = False,
        compile: str | bool = "auto",
        cpu_linear: str = "auto",
        drafter_weight_dtype: str | torch.dtype | None = DRAFTER_WEIGHT_DTYPE,
        adaptive_shape: bool = True,
    ):
        self.target = target
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.device = target.device
        self._lock = target.decode_lock  # one request at a time per target: runtimes sharing it share its cache
        self.backend = resolve_backend(backend, self.device)
        if cpu_linear not in CPU_LINEAR_MODES:  # checked for every backend, not only the torch one
            raise UserError(f"cpu_linear={cpu_linear!r} is not one of {CPU_LINEAR_MODES}")
        layout = getattr(target, "weight_layout", None)
        if cpu_linear == "torch" and layout in ("panels", "amx"):  # packed weights run nowhere but the kernel
            raise UserError(
                "cpu_linear='torch' but the target's weights are packed for the CPU kernel "
                f"(weight_layout={layout!r}): "
                "load it with TargetModel.from_pretrained(..., weight_layout='kn' or 'nk'), or use "
                "SpeculativeRuntime.from_pretrained(..., cpu_linear='torch'), which does"
            )
        self.ops = get_ops(self.backend, cpu_linear)
        self.deterministic = bool(deterministic)  # every op row-invariant (runtime/deterministic.py)
        if self.deterministic:
            if compile is True:
                raise UserError(
                    "deterministic=True runs decode rounds eagerly (a compiled round fuses ops, which may round a "
                    "row differently by batch); pass compile=False"
                )
            self.ops = DeterministicOps(self.ops, self.device)
        if spec is not None and not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a tritonspec.SpecConfig, got {type(spec).__name__}")
        if max_batch_size < 1:
            raise UserError(f"max_batch_size={max_batch_size} must be >= 1")
        self.max_batch_size = max_batch_size
        if not isinstance(adaptive_shape, bool):
            raise UserError(f"adaptive_shape={adaptive_shape!r} must be True or False")
        self.adaptive_shape = adaptive_shape  # greedy requests re-choose their shape as they run (_adapts)
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self._graphs = graph_runner(cuda_graphs, self.device, max_batch_size, cuda_graph_sizes, compile)  # None: eager
        # the shape per request: the caller's, a tuned profile's per batch size and mode (compiled CPU
        # rounds read their own profiles first), or the rule
        self._policy = (
            ShapePolicy.caller(spec) if spec is not None else shape_policy(target, drafter, self.backend, self.compiled)
        )
        self._graph_cache_at: tuple[int, ...] | None = None  # addresses the captured graphs point at
        limit = target.max_position_embeddings
        self.max_seq_len = max_seq_len if max_seq_len is not None else min(limit, 4096)
        if self.max_seq_len > limit:
            raise UserError(f"max_seq_len={self.max_seq_len} exceeds the target's max_position_embeddings={limit}")
        if self.max_seq_len < 2:
            raise UserError(f"max_seq_len={self.max_seq_len} must be >= 2")
        window = getattr(target.config, "sliding_window", None)
        uses_window = getattr(target.config, "use_sliding_window", target.arch == "mistral")
        if window is not None and uses_window and window < self.max_seq_len:
            raise UserError(
                f"the target uses sliding-window attention (window {window}), which is not supported; "
                f"pass max_seq_len <= {window}"
            )
        largest = self._policy.largest(max_batch_size)  # sizes the caches for every shape the policy may pick
        self.drafter_weight_dtype = self._check_drafter_weight_dtype(drafter_weight_dtype, drafter)
        if drafter is not None:
            drafter = self._attach_drafter(drafter, largest)
        self.drafter = drafter  # the caller's module, or this runtime's converted copy of it
        self.decoder = Decoder(
            target,
            drafter,
            self.ops,
            self._policy.choose(1, True).spec or SpecConfig.chain(1),
            max_batch_size=max_batch_size,
            max_seq_len=self.max_seq_len,
            capacity=largest,
        )
        self.decoder.deterministic = self.deterministic
        if self.deterministic:
            self.ops.prepare(target, drafter)  # probe every shape at load: warnings now, not mid-request
            self.decoder.pad_root = not self.ops.one_row_invariant  # plain rounds: a padding node unless not needed

    @property
    def spec(self) -> SpecConfig:
        """The draft-tree shape of the last request, the one it started with (before any: the batch-1
        greedy choice; an adaptive request's switches are in its ``stats.rounds_per_shape``; during
        an open stream, the shape its next round runs).
        Setting it pins every request to that shape (as passing ``spec=`` does)."""
        return self.decoder.spec

    @spec.setter
    def spec(self, spec: SpecConfig) -> None:
        if not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a tritonspec.SpecConfig, got {type(spec).__name__}")
        self._policy = ShapePolicy.caller(spec)
        self.decoder.spec = spec

    @property
    def shape_policy(self) -> ShapePolicy:
        """How requests get their shape (``runtime/spec_policy.py``): ``rt.shape_policy.choose(batch_size,
        greedy, context)`` tells which shape a request would run and why (``context``: its longest
        prompt, in tokens)."""
        return self._policy

    @property
    def graphs_enabled(self) -> bool:
        """Whether decode rounds run as captured CUDA graphs (``cuda_graphs`` on a CUDA device)."""
        return self._graphs is not None and self._graphs.backend == "cuda"

    @property
    def compiled(self) -> bool:
        """Whether decode rounds run compiled on the CPU (``compile=True``; ``runtime/graphs.py``)."""
        return self._graphs is not None and self._graphs.backend == "compile"

    @property
    def cpu_kernels(self) -> bool:
        """Whether the target's linear layers (above ``kernels.cpu_linear``'s size floors), attention
        and RMSNorm run this project's row-invariant CPU kernels (``cpu_linear``: the torch backend on
        an AVX-512 or AVX2 + FMA CPU where they build); False on a GPU or with ``cpu_linear="torch"``."""
        ops = getattr(self.ops, "ops", self.ops)  # DeterministicOps wraps the backend's ops
        return self.device.type == "cpu" and ops.name == "torch" and ops._cpu_kernel(self.target.dtype)

    def warmup(
        self,
        batch_sizes: Sequence[int] | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        speculative: bool = True,
    ) -> list[int]:
        """Capture the decode-round graphs (CUDA) or compile the rounds (CPU, ``compile=True``) now
        instead of on first use (a no-op eager).

        Runs a short dummy generation per batch-size bucket with these sampling settings (graphs
        are keyed by bucket, tree shape and sampling settings; compiled CPU rounds also by their
        attention bound, ``Decoder.kv_bucket``: this compiles the smallest, and a request that
        grows past it compiles the next on first use). Returns the buckets captured.

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
                raise UserError(f"warmup batch size {b} must lie in [1, max_batch_size={self.max_batch_size}]")
            self.generate(
                [[0]] * b,
                max_new_tokens=2,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=0,
                stop_token_ids=(),
                speculative=speculative and self.drafter is not None,
            )
        captured = {k[0] for k in self._graphs.graphs}
        return sorted({self._graphs.bucket(b) for b in sizes} & captured)

    def _check_drafter_weight_dtype(self, value: str | torch.dtype | None, drafter: Any) -> torch.dtype | None:
        """``drafter_weight_dtype`` as None (the drafter's own dtype) or ``torch.bfloat16`` (weight-only bfloat16
        for a float32 pair on the CPU kernels); ``"auto"`` is the latter where it applies. A ``UserError`` that
        says what to change for a value that cannot apply."""
        if value in (None, "float32", torch.float32):
            return None
        if value == "auto" and not getattr(drafter, "loaded_by_runtime", False):
            return None  # a drafter module the caller passed keeps its dtype (shared, not copied)
        if value not in ("auto", "bfloat16", torch.bfloat16):
            raise UserError(
                f"drafter_weight_dtype={value!r}: pass 'auto', None or 'float32' (the drafter's dtype) or 'bfloat16'"
            )
        why = None
        if drafter is None:
            why = "there is no drafter"
        elif self.target.dtype != torch.float32:
            why = f"the pair runs in {str(self.target.dtype).removeprefix('torch.')}, not float32"
        elif torch.float32 not in getattr(self.ops, "packs_cpu_weights", ()):
            why = "this runtime does not pack float32 drafter weights for the CPU panel kernels (a GPU, cpu_linear="
            why += "'torch', or a CPU where float32 panels are not the default: kernels.cpu_linear.panels_default)"
        elif cpu_kernel_unavailable(torch.bfloat16) is not None:
            why = f"the bfloat16 kernels do not run here ({cpu_kernel_unavailable(torch.bfloat16)})"
        if why is None:
            return torch.bfloat16
        if value == "auto":
            return None
        raise UserError(
            f"drafter_weight_dtype='bfloat16' (weight-only bfloat16 drafter projections) needs a float32 pair on "
            f"the CPU kernels, but {why}; drop the option"
        )

    def _attach_drafter(self, d: Eagle3Drafter, spec: SpecConfig) -> Eagle3Drafter:
        """Check the drafter against the target and return the module this runtime runs: the
        caller's when it is already on this device and dtype (and borrows no other target's
        embedding), else a converted copy, so a drafter shared between runtimes is never moved
        or re-attached under another runtime."""
        t, c = self.target, d.config
        w, emb = d.fc.weight, d.embed_tokens
        borrowed = emb is not None and not d.has_own_embedding and emb.weight.data_ptr() != t.embed.data_ptr()
        # the caller's module keeps its own packing (one loaded here for runtimes is repacked in place)
        mine = d.cpu_weight_dtype != self.drafter_weight_dtype and not d.loaded_by_runtime
        if w.dtype != t.dtype or not _same_device(w.device, self.device) or borrowed or mine:
            d = d.converted(self.device, t.dtype)
            c = d.config
        d.cpu_weight_dtype = self.drafter_weight_dtype
        if c.vocab_size != t.vocab_size:
            raise UserError(f"drafter vocab_size={c.vocab_size} does not match the target's vocab_size={t.vocab_size}")
        if c.target_hidden_size != t.hidden_size:
            raise UserError(
                f"drafter target_hidden_size={c.target_hidden_size} does not match the target's "
                f"hidden_size={t.hidden_size}"
            )
        ids = c.aux_layer_ids
        if ids is None:
            ids = default_aux_layer_ids(t.num_layers)
            warnings.warn(
                f"the drafter records no aux layer ids; using EAGLE-3's default boundaries {ids}", stacklevel=3
            )
            c.aux_layer_ids = ids
        if len(ids) != c.num_aux_hidden_states:
            raise UserError(f"drafter expects {c.num_aux_hidden_states} aux states but lists aux layer ids {list(ids)}")
        t.set_aux_layer_ids(ids)
        if spec.top_k > c.draft_vocab_size:
            raise UserError(f"top_k={spec.top_k} exceeds the drafter's draft_vocab_size={c.draft_vocab_size}")
        d.eval()
        d.attach_target_embedding(t.embed, t.drafter_info())
        if d.packs_on(self.ops):
            d.pack_for_cpu()  # now, not at the first (perhaps compiled) round
        return d

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
        deterministic: bool = False,
        compile: str | bool = "auto",
        cpu_linear: str = "auto",
        drafter_weight_dtype: str | torch.dtype | None = DRAFTER_WEIGHT_DTYPE,
        adaptive_shape: bool = True,
    ) -> SpeculativeRuntime:
        """Build a runtime from a target (HF directory or ``PreTrainedModel``) and an optional drafter.

        Parameters
        ----------
        target : Hugging Face model directory, a ``.gguf`` file (dequantized once and cached, see
            ``runtime/gguf.py``), ``"smollm2"``, or a loaded transformers ``PreTrainedModel``.
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
        tokenizer : a transformers tokenizer or a local directory holding one; by default read
            from the target directory when it has one.
        deterministic : make every op row-invariant (``runtime/deterministic.py``): each emitted
            token's logits equal plain one-token decoding's bit for bit, and a request's output
            (greedy, or sampled with its seed) is the same alone or in any batch, with or without
            speculation. Sampling then draws each position's token by a race keyed on (seed,
            position). On a CPU the forwards run on one intra-op thread; on a GPU it needs Triton.
        compile : ``True`` compiles each decode round on a CPU (``torch.compile`` of the same round a
            CUDA graph captures, plain decoding included, one artefact per batch bucket, tree shape
            and sampling setting; lazily or by ``warmup()``); ``"auto"``/``False`` run eager there.
            Compiling takes seconds (tiny models) to minutes (a 30-layer target) per key; a failure
            warns once and runs that key eagerly. The tokens are those of eager rounds.
        cpu_linear : the CPU linear layers (torch backend): ``"auto"`` (``$TRITONSPEC_CPU_LINEAR``,
            default: ``kernels/cpu_linear.py``, a row-invariant AVX-512 / AVX512-BF16 (or AVX2) kernel that
            reads weights at memory speed, where it builds; else ``F.linear``), ``"kernel"`` (an
            error when it cannot run) or ``"torch"`` (``F.linear``, weights stored ``[K, N]`` in float32).
        drafter_weight_dtype : ``"bfloat16"``: a float32 pair on the CPU kernels keeps the drafter's decode-round
            projections and head as bfloat16 panels with float32 activations
            (``kernels.cpu_linear.weight_only_bf16``), half the bytes a draft step reads (~4 % faster end to end
            on SmolLM2); an error where it cannot apply. ``"auto"`` (default): that where it applies to a drafter
            loaded here from a directory (a drafter module you pass keeps its dtype: shared, never copied), else
            the drafter's dtype. ``None`` / ``"float32"``: the drafter runs in the target's dtype. Lossless as ever
            (the target verifies): greedy output is unchanged; the proposals (so τ, and seeded sampled output)
            may move slightly. Prompts keep float32 weights.
        adaptive_shape : ``True`` (default): a greedy request re-chooses its shape from the policy
            whenever the rows a round runs change (a batch narrowing as its rows stop: the
            profile's row for that many rows), and a row running alone on a tuned profile's shape
            re-chooses it between rounds among the shapes the tuner measured, by the acceptance it
            shows (``runtime/adaptive.py``: deep trees where the drafter is accepted deep, small
            ones where it is not); eager rounds, no caller's ``spec``. Output is unchanged (greedy).
            ``False``: every request keeps the shape it started with.

        A drafter object already on ``device`` in the target's dtype is used as is; otherwise the
        runtime runs a converted copy and the caller's module is left untouched. Bad arguments,
        a device this machine lacks, and weights that disagree with their config raise
        ``tritonspec.UserError``.
        """
        target = resolve_target(target)
        layout = "auto" if cpu_linear != "torch" else resolve_layout("auto", torch.device(device), dtype, "torch")
        tm = TargetModel.from_pretrained(target, device=device, dtype=dtype, weight_layout=layout)
        d = drafter
        if isinstance(drafter, (str, Path)):
            d = Eagle3Drafter.from_pretrained(drafter, loaded_by_runtime=True)  # nobody else holds it
        elif drafter is not None and not isinstance(drafter, Eagle3Drafter):
            raise UserError(f"drafter must be a directory or an Eagle3Drafter, got {type(drafter).__name__}")
        if tokenizer is None and isinstance(target, (str, Path)):
            tokenizer = load_tokenizer(Path(target))
        return cls(
            tm,
            d,
            tokenizer,
            backend=backend,
            spec=spec,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            cuda_graphs=cuda_graphs,
            cuda_graph_sizes=cuda_graph_sizes,
            deterministic=deterministic,
            compile=compile,
            cpu_linear=cpu_linear,
            drafter_weight_dtype=drafter_weight_dtype,
            adaptive_shape=adaptive_shape,
        )

    # ================================================================== public API
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] = 128,
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
        ``seed``: one int for every prompt, or one per prompt; the same seed gives the same output at the
        same tree shape (a sampled row's draws follow its rounds: with ``spec=None`` the tuned shape depends on
        the batch, so fix ``spec`` or use ``deterministic=True`` for an output independent of the batch).
        ``max_new_tokens``: one int for every prompt, or one per prompt (vLLM's per-request ``max_tokens``;
        with continuous batching a row whose budget runs out is refilled at the next round).
        ``stop``: stop strings (the text is cut before them, the tokens end with the one that
        completed them). ``token_ids`` include a stop token that ended the row.
        ``speculative=False`` runs plain target decoding through the same runtime (the baseline).

        Chat: ``prompts`` may be one conversation (``[{"role": "user", "content": "..."}]``) or a
        list of conversations; the tokenizer's chat template is applied with the generation prompt
        and the template's end-of-turn token (e.g. ``<|im_end|>``) stops the row. A plain string
        stays raw text.
        ``prompts``: a string, a list of strings, a token id list, a list of them, or a 1-D / 2-D
        integer tensor or numpy array; ids, seeds and sizes may be numpy or torch integers. Bad
        input raises ``tritonspec.UserError`` naming the value. Requests are serialised (the module
        docstring): a call from another thread waits for the running one.
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

        An open stream holds the runtime (see the module docstring): iterate it to the end or call
        its ``close()``; a ``generate`` in the same thread meanwhile raises a ``UserError``, one in
        another thread waits.

        Examples
        --------
        >>> for piece in rt.stream("def f(x):", max_new_tokens=32):   # doctest: +SKIP
        ...     print(piece.text, end="", flush=True)
        """
        run = self._start(
            one_prompt(prompt),
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            speculative,
            stop,
        )
        sent, n_tok = 0, 0
        hold = max((len(x) for x in run.sampling.stop), default=1) - 1
        try:
            for rows in run:
                toks = rows.outs[0]
                done = rows.done[0]
                text = rows.text(0) if self.tokenizer is not None else ""
                if not done:
                    text = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its bytes
                    text = text[: max(sent, len(text) - hold)]
                if len(text) > sent or len(toks) > n_tok:
                    yield StreamPiece(text=text[sent:], token_ids=toks[n_tok:])
                    sent, n_tok = max(sent, len(text)), len(toks)
        finally:
            run.close()  # a stream broken off releases the runtime now
        out = run.result
        final = out.texts[0] if out.texts is not None else ""
        yield StreamPiece(text=final[sent:], token_ids=[], finish_reason=out.finish_reasons[0], stats=out.stats)

    def _start(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, speculative, stop):
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        sampling = SamplingParams(
            temperature=as_float(temperature, "temperature"),
            top_p=as_float(top_p, "top_p"),
            top_k=as_int(top_k, "top_k"),
            stop=stops,
        )
        if speculative and self.drafter is not None:
            w = self.drafter.fc.weight
            if w.dtype != self.target.dtype or not _same_device(w.device, self.device):
                raise UserError(
                    f"the drafter was moved to {w.device} / {w.dtype} after this runtime was built for "
                    f"{self.device} / {self.target.dtype}; move it back, or build a new runtime"
                )
        if stops and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer: load a target directory that has one or pass tokenizer=")
        batch = encode_prompts(
            prompts,
            self.tokenizer,
            vocab_size=self.target.vocab_size,
            max_seq_len=self.max_seq_len,
            max_batch_size=None,  # more prompts than rows: continuous batching (_decode)
        )
        if self.decoder.observer is not None and len(batch) > self.max_batch_size:
            raise UserError(
                f"observed decoding (observe()) runs one static batch: {len(batch)} prompts exceed "
                f"max_batch_size={self.max_batch_size}; pass at most that many"
            )
        seeds = row_seeds(seed, len(batch), sampling)
        budgets = row_budgets(max_new_tokens, len(batch))
        if speculative and self.drafter is None:
            warnings.warn("no drafter loaded: speculative=True runs plain decoding", stacklevel=3)
        context = max(len(p) for p in batch)  # long prompts may get smaller trees (a profile's context rows)
        choice = self._choose_shape(min(len(batch), self.max_batch_size), sampling, speculative, context)
        if choice.spec is not None and choice.source != "caller" and self.device.type == "cpu":
            prompt, new, ratio = sum(map(len, batch)), sum(budgets), self._prompt_pass_ratio
            if not prompt_pass_pays(prompt, new, max(budgets), ratio):
                why = (
                    f"plain: {new} new token(s) do not pay for the drafter's pass over {prompt} prompt tokens "
                    f"(from {ratio:.3f} a prompt token, or more than one a prompt; runtime/spec_policy.py)"
                )
                choice = ShapeChoice(None, why)
        requests = RequestRows(
            [len(p) for p in batch],
            max_new_tokens=budgets,
            max_seq_len=self.max_seq_len,
            stop_ids=resolve_stop_ids(
                stop_token_ids, self.tokenizer, self.target.config, self.target.vocab_size, chat=is_chat(prompts)
            ),
            sampling=sampling,
            tokenizer=self.tokenizer,
        )
        return _Run(self._decode(batch, requests, sampling, seeds, choice), sampling, self._lock)

    @functools.cached_property
    def _prompt_pass_ratio(self) -> float:
        """``spec_policy.prompt_pass_ratio`` of this pair: the drafter's prompt FLOPs per token (its parameters but
        the embedding and head, twice) over the target's weight bytes read per decode step (its layers and head,
        each tensor once; the embedding reads one row)."""
        d, t = self.drafter, self.target
        skip = {id(p) for m in (d.embed_tokens, d.lm_head) if m is not None for p in m.parameters()}
        flops = 2.0 * sum(p.numel() for p in d.parameters() if id(p) not in skip)
        tensors = [w for L in t.layers for w in vars(L).values() if isinstance(w, torch.Tensor)] + [t.lm_head]
        nbytes = sum(w.numel() * w.element_size() for w in {id(w): w for w in tensors}.values())
        return prompt_pass_ratio(flops, nbytes)

    def _choose_shape(
        self, batch_size: int, sampling: SamplingParams, speculative: bool, context: int = 0
    ) -> ShapeChoice:
        """The shape this request runs (None: plain decoding) and why (``runtime/spec_policy.py``);
        ``context``: its longest prompt, in tokens."""
        if not speculative:
            return ShapeChoice(None, "speculative=False")
        if self.drafter is None:
            return ShapeChoice(None, "no drafter")
        return self._policy.choose(batch_size, sampling.greedy, context)

    def _decode(
        self,
        batch: list[list[int]],
        requests: RequestRows,
        sampling: SamplingParams,
        seeds: list[int],
        choice: ShapeChoice,
    ) -> Iterator[RequestRows]:
        """The decode loop: prefill, then rounds until every request has stopped. Yields the
        requests after the prefill, after each admission and after each round; returns the output.

        Continuous batching: the first ``max_batch_size`` prompts are prefilled together; when a
        row finishes, the next waiting prompt is prefilled alone into that row (``Decoder.admit``)
        before the next round, so rows leave from anywhere and the others wait one prefill per
        newcomer. Every prompt's output equals its solo run (each row's ops and random stream are
        its own)."""
        dec = self.decoder
        use_draft = choice.spec is not None
        if use_draft:
            dec.spec = choice.spec
        # greedy rows re-choose their shape as the rows a round runs change, a row alone by its acceptance too
        by_width = use_draft and self._adapts(sampling)  # (_by_width)
        if by_width:  # the caches fit every shape the policy may pick (the prefill regrows the round buffers)
            dec.fit([self._policy.largest(self.max_batch_size)])
        stats = SpecStats(accepted_per_position=[0] * self.spec.tree_depth if use_draft else [])  # + deeper shapes run
        stats.spec, stats.spec_source = choice.spec, choice.source
        tracker: ShapeTracker | None = None  # a row alone on a profile's ladder (runtime/adaptive.py)
        rows_key: tuple[int, int] | None = None  # (running rows, their longest prompt) the shape was chosen for
        t0 = time.perf_counter()
        first_batch = min(len(batch), self.max_batch_size)
        fresh = first_batch  # rows that have run no round yet (their shape is no switch)
        slot_req: list[int | None] = list(range(first_batch))  # the request each row decodes
        waiting = list(range(len(batch) - 1, first_batch - 1, -1))  # the rest, next one last (pop())
        with torch.inference_mode(), self._pinned():  # never across a yield: the caller's code runs between rounds
            dec.prefill(
                batch[:first_batch],
                speculative=use_draft,
                sampling=sampling,
                seeds=seeds[:first_batch],
                rows=self._rows(first_batch),
                timings=stats.time_split_s,
            )
            first = dec.first_tokens()
        self._emit(dec, requests, slot_req, [[t] for t in first])
        yield requests
        try:
            while True:
                free = (
                    [b for b in range(self.max_batch_size) if b >= len(dec.running) or not dec.running[b]]
                    if waiting
                    else []
                )
                if free:  # refill finished rows, lowest first (keeps the round's rows few)
                    for b in free[: len(waiting)]:
                        r = waiting.pop()
                        rows_key = None  # a new request: its shape (and acceptance) chosen anew (_by_width)
                        fresh += 1
                        with torch.inference_mode(), self._pinned():
                            tok = dec.admit(b, batch[r], seeds[r], timings=stats.time_split_s)
                        slot_req += [None] * (b + 1 - len(slot_req))
                        slot_req[b] = r
                        stats.rows_refilled += 1
                        self._emit(dec, requests, slot_req, [[tok] if i == b else [] for i in range(len(slot_req))])
                    yield requests
                if not any(dec.running):
                    if waiting:
                        continue  # every newcomer stopped at its first token: admit the next ones
                    break
                if not waiting:
                    stats.rows_moved += self._compact(dec, slot_req)
                live = max(b for b, a in enumerate(dec.running) if a) + 1
                if self._rows(live) != dec.rows:  # finished rows at the end shrink the round; newcomers widen it
                    dec.narrow(self._rows(live))
                if by_width and (key := self._rows_key(dec, slot_req, batch)) != rows_key:
                    rows_key = key
                    tracker = self._by_width(dec, stats, sampling, *key, switch=fresh < key[0])
                fresh = 0
                with torch.inference_mode(), self._pinned():
                    self._dispatch_round(stats)
                    new = dec.collect()
                if use_draft:
                    stats.count_shape(dec.spec)
                    stats.count_round([len(t) - 1 for t in new if t], dec.take_draft_nodes())
                self._emit(dec, requests, slot_req, new)
                if tracker is not None:  # rows still running: the drafter nodes they accepted, + 1 (the
                    # model's tokens per round); a round whose lookup branch went further says nothing of it
                    seen = [
                        d + 1 for b, d in enumerate(dec.drafted) if b < len(dec.running) and dec.running[b] and d >= 0
                    ]
                    if (nxt := tracker.observe(seen)) is not None:
                        dec.spec = nxt  # the next round drafts and verifies this shape (runtime/adaptive.py)
                        stats.shape_switches += 1
                yield requests
        finally:  # rt.spec: the shape the request started with, whatever it switched to
            dec.track_drafted = False
            if by_width:
                dec.spec = choice.spec
        stats.wall_time_s = time.perf_counter() - t0
        stats.num_new_tokens = sum(len(o) for o in requests.outs)
        texts = None
        if self.tokenizer is not None:
            texts = [requests.text(b) for b in range(len(requests.outs))]
        return GenerationOutput(token_ids=requests.outs, texts=texts, stats=stats, finish_reasons=requests.reasons)

    def _adapts(self, sampling: SamplingParams) -> bool:
        """Whether a request may re-choose its shape between rounds (``_by_width``, ``runtime/adaptive.py``):
        the runtime allows it, the policy is not the caller's one shape, greedy (a seeded sampled row's
        draws follow its rounds, so its output would depend on the batch it shares), eager rounds (a
        compiled or captured round is one artifact per shape) and no drift observer (it records one
        shape's depths)."""
        eager = self._graphs is None or not self._graphable()
        return (
            self.adaptive_shape
            and self._policy.fixed is None
            and sampling.greedy
            and eager
            and self.decoder.observer is None
        )

    @staticmethod
    def _rows_key(dec: Decoder, slot_req: list[int | None], batch: list[list[int]]) -> tuple[int, int]:
        """(running rows, the longest prompt among them): what ``_by_width`` chooses the shape for."""
        live = [b for b, a in enumerate(dec.running) if a]
        return len(live), max(len(batch[slot_req[b]]) for b in live)

    def _by_width(
        self, dec: Decoder, stats: SpecStats, sampling: SamplingParams, rows: int, context: int, *, switch: bool
    ) -> ShapeTracker | None:
        """Re-choose the running shape when the rows a round runs change: a static batch narrowing as its
        rows stop, a continuous batch refilled or draining, a long prompt joining or leaving. The policy's
        shape for ``rows`` rows whose longest prompt has ``context`` tokens (a profile measures one per batch
        size: a batch-4 chain verified on the one row left is far shorter than that row's batch-1 shape).
        A row alone takes the profile's ladder (``runtime/adaptive.py``): returns its tracker, else None.
        Where the policy would decode plainly at this width the drafted shape stays (switching back would
        need the drafter's cache caught up). Greedy output is the target's whatever the shape. ``switch``: some
        row ran a round before (a change counts in ``SpecStats.shape_switches``; a new request's first shape
        does not)."""
        c = self._choose_shape(rows, sampling, True, context)
        if c.spec is not None and c.spec != dec.spec:
            dec.spec = c.spec
            stats.shape_switches += switch
        lad = c.ladder if rows == 1 and c.spec is not None else None  # (choose gives a ladder holding c.spec)
        dec.track_drafted = lad is not None
        return lad.track(dec.spec) if lad is not None else None

    def _compact(self, dec: Decoder, slot_req: list[int | None]) -> int:
        """No prompt waits: move the last running rows into finished rows below them (``Decoder.move_row``),
        so the round narrows to the rows still decoding; returns the rows moved. Eager rounds only (a
        graph or compiled round per row count would be captured or compiled anew), not under an ops
        proxy that keeps rows by position or an observer (``Decoder.rows_in_place``)."""
        if (self._graphs is not None and self._graphable()) or dec.rows_in_place:
            return 0
        moved = 0
        slot_req += [None] * (len(dec.running) - len(slot_req))
        while True:
            free = [b for b, a in enumerate(dec.running) if not a]
            live = [b for b, a in enumerate(dec.running) if a]
            if not free or not live or free[0] > live[-1]:
                return moved
            src, dst = live[-1], free[0]
            dec.move_row(src, dst)
            slot_req[dst], slot_req[src] = slot_req[src], None
            moved += 1

    @staticmethod
    def _emit(dec: Decoder, requests: RequestRows, slot_req: list[int | None], new: list[list[int]]) -> None:
        """Hand each row's new tokens to its request; retire the rows whose request finished."""
        per_req: list[list[int]] = [[] for _ in requests.outs]
        for b, toks in enumerate(new):
            if toks and b < len(slot_req) and slot_req[b] is not None:
                per_req[slot_req[b]] = toks
        done = set(requests.emit(per_req))
        dec.finish([b for b, r in enumerate(slot_req) if r is not None and r in done and dec.running[b]])

    def _pinned(self) -> contextlib.AbstractContextManager:
        """Deterministic mode on a CPU: one intra-op thread inside the forwards (``DeterministicOps.threads``)."""
        return self.ops.threads() if self.deterministic else contextlib.nullcontext()

    def _graph_addresses(self) -> tuple[int, ...]:
        """Addresses of the tensors a captured round reads that can be replaced under it: the
        decoder's buffers and drafter cache (re-made when the tree grows), the target's cache and rope tables (the
        cache grows for a runtime sharing the target), the drafter's rope tables and weights
        (another runtime may grow or move them)."""
        t = self.target
        ts_ = [*self.decoder.bufs.tensors(), t.k_cache, t.v_cache, t.rope.cos, t.rope.sin]
        if self.drafter is not None:
            r, cache = self.drafter.rope(), self.decoder.draft_cache
            ts_ += [r.cos, r.sin, cache.k, cache.v, *self.drafter.parameters(), *self.drafter.cpu_pack_tensors()]
        return tuple(x.data_ptr() for x in ts_)

    def _graphable(self) -> bool:
        """Whether rounds may be captured: not under a drift observer or an ops proxy that reads the
        host each round (``runtime.audit.EmissionRecorder``); those rounds run eagerly."""
        dec = self.decoder
        return dec.observer is None and not getattr(dec.ops, "reads_host", False)

    def _rows(self, live: int) -> int:
        """Rows a round runs on: ``live`` (eager) or its graph bucket (``live <= max_batch_size``)."""
        if self._graphs is None or not self._graphable():
            return live
        b = self._graphs.bucket(live)
        return live if b is None else b

    def _dispatch_round(self, stats: SpecStats) -> None:
        """Replay (or capture) the round's graph for this bucket, or run it eagerly."""
        g, dec = self._graphs, self.decoder
        if g is not None and self._graphable():
            if self.drafter is not None:  # a weight changed in place: repack its copy where the graphs read it
                self.drafter.refresh_cpu_pack()
            where = self._graph_addresses()
            if where != self._graph_cache_at:  # e.g. another runtime grew the shared cache: graphs point at the old one
                g.reset()
                self._graph_cache_at = where
            sp = dec.sampling
            # a compiled CPU round attends up to a power-of-two bound of the lengths (part of its key);
            # a CUDA graph over the whole cache (its attention kernel skips the slots past each row)
            kv = dec.kv_bucket() if g.backend == "compile" else None
            key = (dec.rows, dec.speculative, self.spec, sp.temperature, sp.top_p, sp.top_k, kv)
            t0 = time.perf_counter()
            if g.run(key, lambda: dec.round(whole_cache=True, kv_cap=kv), dec.bufs.tensors()):
                stats.time_split_s["graph"] = stats.time_split_s.get("graph", 0.0) + time.perf_counter() - t0
                return
        drafting = dec.drafter is not None and dec.speculative  # its packed weights looked up once a round
        with dec.drafter.packed_for_round(dec.ops) if drafting else contextlib.nullcontext():
            dec.round(timings=stats.time_split_s)

    @contextlib.contextmanager
    def observe(self, observer: DraftObserver) -> Iterator[None]:
        """Run the drafter's forwards under ``observer`` (e.g. ``runtime.drift.DriftRecorder``)
        inside the ``with`` block; observed rounds run eagerly."""
        self.decoder.observer = observer
        try:
            yield
        finally:
            self.decoder.observer = None


class _Run:
    """Iterates a decode loop (yielding the requests after each round) while holding the target's
    ``DecodeLock``, and keeps its return value. ``close()`` ends it early and releases the lock."""

    def __init__(self, gen: Iterator[RequestRows], sampling: SamplingParams, lock):
        self.sampling, self.result = sampling, None
        self._it = self._run(gen, lock)

    def _run(self, gen: Iterator[RequestRows], lock) -> Iterator[RequestRows]:
        with lock.hold():  # taken at the first step (the prefill), not when the request is built
            self.result = yield from gen

    def __iter__(self) -> Iterator[RequestRows]:
        return self._it

    def close(self) -> None:
        self._it.close()


def resolve_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as is, None, or the tokenizer of a local directory (str or Path); anything
    else is a ``UserError`` saying what is accepted."""
    accepted = "pass a transformers tokenizer (AutoTokenizer.from_pretrained(...)) or a local directory holding one"
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, Path)):
        tok = load_tokenizer(Path(tokenizer)) if Path(tokenizer).is_dir() else None
        if tok is None:
            raise UserError(f"tokenizer={str(tokenizer)!r} is not a directory with tokenizer files: {accepted}")
        return tok
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise UserError(f"tokenizer of type {type(tokenizer).__name__} is not a tokenizer: {accepted}")
    return tokenizer


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (``cuda`` is the current ``cuda:N``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
