"""The op layer: every hot-path call site in the runtime goes through one ``Ops`` object.

``Ops`` states what a backend provides. ``backend="torch"`` (``TorchOps``) uses the plain PyTorch
``<op>_reference`` functions from ``kernels/`` (the reference path, and the fast path on a CPU).
``backend="triton"`` (``kernels.triton_ops.TritonOps``) swaps in the Triton launchers without
touching the runtime code above. Both satisfy ``Ops`` structurally: the kernels never import the
runtime.
"""

from __future__ import annotations

import functools
import os
from typing import Protocol

import torch
import torch.nn.functional as F

from ..kernels import cpu_attention as _cpu_attention
from ..kernels import cpu_linear as _cpu_linear
from ..kernels import cpu_norm as _cpu_norm
from ..kernels import cpu_prefill as _cpu_prefill
from ..kernels import cpu_rope as _cpu_rope
from ..kernels import cpu_tree as _cpu_tree
from ..kernels.aux_gather import aux_gather_reference
from ..kernels.kv_compact import kv_compact_reference
from ..kernels.kv_write import kv_write_reference
from ..kernels.prefill_attention import prefill_attention
from ..kernels.rms_norm import rms_norm_reference
from ..kernels.tree_attention import tree_visibility
from ..kernels.verify import verify_greedy_reference
from ..kernels.verify_chain import verify_chain_reference
from ..kernels.verify_sampling import verify_sampling_reference
from .errors import UserError

BACKENDS = ("auto", "torch", "triton")


class Ops(Protocol):
    """What a backend must provide: the hot-path ops, with the contracts of ``kernels/<op>.py``.

    Every backend computes the ``<op>_reference`` semantics (bit for bit for the discrete ops,
    within the kernels' stated bounds for the float ones). Index tensors are int64; no op syncs
    with the host, so a round of them can be captured as a CUDA graph.
    """

    name: str  # "torch" or "triton"

    def begin_forward(self, prompt: bool = False) -> None:
        """A model forward starts (called before its first layer): drop anything cached for the
        previous forward (the round updates ``prefix_lens`` in place between forwards). ``prompt``:
        this forward is a prompt's (``meta.prefill``), whose rows need not round like a decode
        step's (the torch backend then runs float32 linear layers of many rows through MKL on AVX2)."""

    def linear(
        self,
        x: torch.Tensor,  # [..., K]
        weight: torch.Tensor,  # [N, K] (a module's weight, in whatever layout the backend prepared)
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [..., N]
        """``x @ weight.T + bias`` (``F.linear``): every projection of the target and the drafter."""

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None = None,  # [..., H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of the last axis; with ``residual``, ``(norm(x + residual), x + residual)``."""

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [..., 2 * I]: gate columns, then up columns
    ) -> torch.Tensor:  # [..., I]
        """SwiGLU's ``silu(gate) * up`` (``kernels.cpu_norm.silu_mul_reference``), elementwise: each row's values
        independent of the others."""

    def aux_gather(
        self,
        aux: torch.Tensor,  # [n_src, n_aux*H]
        index: torch.Tensor,  # [n] int64, -1 = padding row (all zeros out)
        fc_norm_weight: torch.Tensor | None,  # [n_aux, H], or None: plain gather
        eps: float,
    ) -> torch.Tensor:  # [n, n_aux*H]
        """Rows of ``aux`` at ``index``, each H-wide chunk RMS-normalised when ``fc_norm_weight`` is given."""

    def kv_write(
        self,
        k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer), or [L, B_max, S, Hkv, D] with layer
        v_cache: torch.Tensor,  # same shape as k_cache
        slots: torch.Tensor,  # [B, Q] int64 absolute slot per query, -1 = the trash slot S-1
        k: torch.Tensor,  # [B, Q, Hkv, D]
        v: torch.Tensor,  # [B, Q, Hkv, D]
        layer: int | None = None,  # the caches are [L, B_max, S, Hkv, D]: write this layer (through the stack)
    ) -> None:
        """Scatter the new tokens' K/V into the cache, in place (cast to the cache dtype)."""

    def rope(
        self,
        x: torch.Tensor,  # [B, Q, H, D]
        cos: torch.Tensor,  # [B, Q, 1, D] (``Rope.tables``)
        sin: torch.Tensor,  # [B, Q, 1, D]
    ) -> torch.Tensor:  # [B, Q, H, D]
        """Rotary embedding, ``kernels.cpu_rope.rope_reference`` bit for bit."""

    def tree_attention(
        self,
        q: torch.Tensor,  # [B, Q, Hq, D]
        k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer), the queries' own K/V already written
        v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
        prefix_lens: torch.Tensor,  # [B] int64: slots [0, prefix_lens) are the committed prefix
        tree_mask: torch.Tensor,  # [B, Q, T] bool over the tree region [prefix_lens, prefix_lens + T)
        scale: float,
        kv_len: int | None = None,  # host-known bound on prefix_lens + T: a speed hint, never a result change
    ) -> torch.Tensor:  # [B, Q, Hq, D]
        """Attention of each query over the whole prefix plus the tree slots its mask row allows
        (GQA: query head h reads KV head h // (Hq / Hkv)); no visible key gives zeros."""

    def prefill_attention(
        self,
        q: torch.Tensor,  # [B, P, Hq, D]
        k: torch.Tensor,  # [B, P, Hkv, D]
        v: torch.Tensor,  # [B, P, Hkv, D]
        scale: float,
    ) -> torch.Tensor:  # [B, P, Hq, D]
        """Causal self-attention of a prompt with an empty prefix (not a decode-round op)."""

    def verify_greedy(
        self,
        tokens: torch.Tensor,  # [B, N] int64, node 0 = root
        parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
        target_argmax: torch.Tensor,  # [B, N] int64, the target's greedy token after each node
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy tree walk from the root (lowest matching child id first): ``(nodes [B, max_depth+1]``
        root + accepted node ids, ``num_accepted [B]``, ``emitted [B, max_depth+1]`` accepted tokens then
        the bonus token), -1 padded."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...] int64
        """``logits.argmax(-1)`` exactly (the lowest index of a row's maximum; a NaN above every number):
        the target's greedy token after each verified node (``TargetModel.greedy``)."""

    def verify_sampling(
        self,
        tokens: torch.Tensor,  # [B, N] int64, node 0 = root
        parents: torch.Tensor,  # [B, N] int64, parents[:, 0] = -1, -1 = padding node
        probs: torch.Tensor,  # [B, N, V] float32 target probabilities after logits processing
        uniforms: torch.Tensor,  # [B, N] float32 in [0, 1), one coin per node
        exp_noise: torch.Tensor,  # [B, V] float32, Exp(1), > 0
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lossless tree verification (sampling without replacement against ``probs``), deterministic
        given ``uniforms`` and ``exp_noise``: ``(nodes, num_accepted, emitted)`` as ``verify_greedy``."""

    def verify_chain(
        self,
        tokens: torch.Tensor,  # [B, n+1] int64, node 0 = root, node i = the depth-i draft
        probs: torch.Tensor,  # [B, n+1, V] float32 target probabilities
        draft_probs: torch.Tensor,  # [B, n, V] float32, row i-1 = the distribution draft i was drawn from
        uniforms: torch.Tensor,  # [B, n+1] float32 in [0, 1), column i = depth i's coin
        exp_noise: torch.Tensor,  # [B, V] float32, Exp(1), > 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Standard speculative sampling of a sampled draft chain: ``(nodes [B, n+1], num_accepted [B],
        emitted [B, n+1])``, deterministic given ``uniforms`` and ``exp_noise``."""

    def kv_compact(
        self,
        k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
        v_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
        start: torch.Tensor,  # [B] int64, slot of the tree root per row
        nodes: torch.Tensor,  # [B, M] int64, accepted node ids (root first), -1 = none
    ) -> None:
        """Move the accepted path's K/V to slots ``start .. start + a`` of every layer, in place."""


def _argmax_reference(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
    return logits.argmax(-1)


class TorchOps:
    """Reference backend (an ``Ops``): each method is the matching ``kernels.<op>.<op>_reference``."""

    name = "torch"

    def linear(self, x, weight, bias=None):
        """``F.linear``; on the CPU, ``kernels.cpu_linear`` (row-invariant, weights read at memory
        speed) for float32/bfloat16 where it builds (``TRITONSPEC_CPU_LINEAR``). The weight may be
        stored ``[K, N]`` (``TargetModel.weight_layout``); such a weight runs ``F.linear``. A weight
        packed for the kernel (``weight_layout="amx"`` or ``"panels"``) runs only the kernel."""
        if x.is_cpu and (self._cpu_kernel(x.dtype) or weight.dim() >= 3):
            return _cpu_linear.linear(x, weight, bias, self._prompt)
        return F.linear(x, weight, bias)

    @functools.cached_property
    def packs_cpu_weights(self) -> frozenset[torch.dtype]:
        """The dtypes whose drafters run their CPU projections packed into panels here
        (``Eagle3Drafter.pack_for_cpu``), as the target's ``weight_layout="auto"`` packs them: the kernel
        runs the dtype and ``kernels.cpu_linear.panels_default(dtype)`` (AVX2 CPUs; float32 on
        AVX-512 ones). Empty: no packing. Decided once per backend, as ``_cpu_kernel`` is (the drafter
        asks on every call outside a round)."""
        return frozenset(t for t in _cpu_linear.DTYPES if self._cpu_kernel(t) and _cpu_linear.panels_default(t))

    def _cpu_kernel(self, dtype: torch.dtype) -> bool:
        on = self._kernel_for.get(dtype)
        if on is None:
            ok = dtype in (torch.float32, torch.bfloat16)
            on = self._kernel_for[dtype] = ok and _cpu_linear.enabled(dtype, self.cpu_linear)
        return on

    def rms_norm(self, x, weight, eps, residual=None):
        """``kernels.rms_norm.rms_norm_reference``; on the CPU, ``kernels.cpu_norm`` where the CPU
        kernels run (the ``cpu_linear`` switch): one op a call, each row's sum in one fixed order."""
        if x.is_cpu and self._cpu_kernel(x.dtype):
            out = _cpu_norm.rms_norm(x, weight, eps, residual)
            if out is not None:
                return out
        return rms_norm_reference(x, weight, eps, residual)

    def silu_mul(self, gate_up):
        """``kernels.cpu_norm.silu_mul_reference``; on the CPU, ``kernels.cpu_norm.silu_mul`` where the CPU kernels
        run (the ``cpu_linear`` switch): one native pass instead of two PyTorch ops over strided halves."""
        if gate_up.is_cpu and self._cpu_kernel(gate_up.dtype):
            out = _cpu_norm.silu_mul(gate_up)
            if out is not None:
                return out
        return _cpu_norm.silu_mul_reference(gate_up)

    def aux_gather(self, aux, index, fc_norm_weight, eps):
        """``kernels.aux_gather.aux_gather_reference``; on the CPU, ``kernels.cpu_norm.aux_gather`` where the CPU
        kernels run (the ``cpu_linear`` switch): one native call, each chunk's RMSNorm by ``cpu_norm``'s kernel."""
        if aux.is_cpu and self._cpu_kernel(aux.dtype):
            out = _cpu_norm.aux_gather(aux, index, fc_norm_weight, eps)
            if out is not None:
                return out
        return aux_gather_reference(aux, index, fc_norm_weight, eps)

    def kv_write(self, k_cache, v_cache, slots, k, v, layer=None):
        """``kernels.kv_write.kv_write_reference``; eager CPU calls where the CPU kernels run copy the
        rows in C (``kernels.cpu_rope.kv_write``: the same bytes, one call instead of ~9 ops)."""
        if k.is_cpu and self._cpu_kernel(k.dtype):
            return _cpu_rope.kv_write(k_cache, v_cache, slots, k, v, layer)
        return kv_write_reference(k_cache, v_cache, slots, k, v, layer)

    def rope(self, x, cos, sin):
        """``kernels.cpu_rope.rope_reference``; eager CPU calls where the CPU kernels run use the C
        kernel (``kernels.cpu_rope.rope``: the same bits, one call instead of ~7 ops)."""
        if x.is_cpu and self._cpu_kernel(x.dtype):
            return _cpu_rope.rope(x, cos, sin)
        return _cpu_rope.rope_reference(x, cos, sin)

    def __init__(self, cpu_linear: str = "auto") -> None:
        if cpu_linear not in _cpu_linear.MODES:
            raise UserError(f"cpu_linear={cpu_linear!r} is not one of {_cpu_linear.MODES}")
        self.cpu_linear = cpu_linear  # "auto" ($TRITONSPEC_CPU_LINEAR; default: the kernel where it runs)
        self._kernel_for: dict[torch.dtype, bool] = {}  # dtype -> CPU linear runs kernels.cpu_linear
        self._vis: tuple | None = None  # (prefix_lens, tree_mask, kv_len, visibility) of this forward
        self._prompt = False  # this forward is a prompt's (begin_forward): kernels.cpu_linear's prompt rows

    def begin_forward(self, prompt: bool = False) -> None:
        """A new model forward starts: forget the cached visibility mask (the round updates
        ``prefix_lens`` in place, so the same tensor object holds new lengths in the next forward);
        ``prompt``: a prompt's forward (``Ops.begin_forward``)."""
        self._vis = None
        self._prompt = prompt

    def tree_attention(self, q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len=None):
        """``kernels.tree_attention.tree_attention_reference``. On the CPU, ``kernels.cpu_attention``
        where the CPU kernels run (the ``cpu_linear`` switch): row-invariant, each query's visible
        keys only. Otherwise SDPA with two speed-ups that do not change the math: the visibility mask
        is built once per forward (every layer passes the same ``prefix_lens``/``tree_mask`` objects;
        ``begin_forward`` clears it) and GQA heads are broadcast, not copied."""
        if q.is_cpu and self._cpu_kernel(q.dtype):
            out = _cpu_attention.tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len)
            if out is not None:
                return out
        B = q.shape[0]
        S = k_cache.shape[1] if kv_len is None else kv_len
        c = self._vis
        if c is None or c[0] is not prefix_lens or c[1] is not tree_mask or c[2] != S:
            c = self._vis = (prefix_lens, tree_mask, S, tree_visibility(prefix_lens, tree_mask, S)[:, None])
        k = k_cache[:B, :S].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        v = v_cache[:B, :S].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=c[3], scale=scale, enable_gqa=q.shape[2] != k.shape[1]
        )
        return out.transpose(1, 2)

    def prefill_attention(self, q, k, v, scale):
        """``kernels.prefill_attention.prefill_attention`` (PyTorch's causal SDPA); on AVX-512 CPUs where the
        CPU kernels run (the ``cpu_linear`` switch), float32 eager calls take ``kernels.cpu_prefill``
        (the masked half skipped: 0.5-0.85x SDPA's time at 58-1,600 tokens, ``perf/CPU_DECODE.md``)."""
        if q.is_cpu and self._cpu_kernel(q.dtype) and _cpu_prefill.runs(q, k, v):
            return _cpu_prefill.cpu_prefill_attention_unchecked(q, k, v, scale)  # runs() checked them
        return prefill_attention(q, k, v, scale)

    @property
    def cpu_index(self) -> bool:
        """Whether the round's index bookkeeping on CPU tensors runs the C operators of
        ``kernels.cpu_tree`` (greedy verification and the K/V compaction here; the tree build, prompt
        lookup and graft in ``runtime/decode.py``): where the CPU kernels run (the ``cpu_linear`` switch). Exact: the
        same integers as the references, one call instead of 30-130 small ops."""
        return self._cpu_kernel(torch.float32) or self._cpu_kernel(torch.bfloat16)

    def _index_op(self, c_op, reference, *args):
        """``reference(*args)``, as ``kernels.cpu_tree``'s C operator ``c_op`` on eager CPU calls where
        ``cpu_index`` holds (it returns None where it does not run: then the reference)."""
        out = c_op(*args) if args[0].is_cpu and self.cpu_index else None
        return reference(*args) if out is None else out

    def verify_greedy(self, tokens, parents, target_argmax, max_depth):
        """``kernels.verify.verify_greedy_reference`` (``_index_op``: the same integers)."""
        return self._index_op(
            _cpu_tree.verify_greedy, verify_greedy_reference, tokens, parents, target_argmax, max_depth
        )

    def argmax(self, logits):
        """``logits.argmax(-1)`` (the verify's greedy token per node); eager CPU calls where ``cpu_index``
        holds run ``kernels.cpu_tree.argmax`` (``_index_op``: the same indices, the rows over the intra-op
        threads, ~0.1x ATen's time on a 49,152-token head)."""
        return self._index_op(_cpu_tree.argmax, _argmax_reference, logits)

    verify_sampling = staticmethod(verify_sampling_reference)

    def verify_chain(self, tokens, probs, draft_probs, uniforms, exp_noise):
        """``kernels.verify_chain.verify_chain_reference`` (``_index_op``: the same tokens and counts)."""
        return self._index_op(
            _cpu_tree.verify_chain, verify_chain_reference, tokens, probs, draft_probs, uniforms, exp_noise
        )

    def kv_compact(self, k_cache, v_cache, start, nodes):
        """``kernels.kv_compact.kv_compact_reference``; eager CPU calls run ``kernels.cpu_tree``'s C
        operator where ``cpu_index`` holds (the same bytes moved)."""
        if k_cache.is_cpu and self.cpu_index and _cpu_tree.kv_compact(k_cache, v_cache, start, nodes):
            return
        kv_compact_reference(k_cache, v_cache, start, nodes)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` is ``triton`` on a CUDA device when Triton imports, else ``torch``."""
    if backend not in BACKENDS:
        raise UserError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            from ..kernels import triton_ops  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def get_ops(backend: str, cpu_linear: str = "auto") -> Ops:
    """The ``Ops`` object for a resolved backend name (``torch`` or ``triton``); ``cpu_linear``: the
    torch backend's CPU linear layers (``TorchOps``)."""
    if backend == "torch":
        return TorchOps(cpu_linear)
    if backend == "triton":
        try:
            from ..kernels.triton_ops import TritonOps
        except ImportError as e:  # triton missing or kernels not built
            raise UserError(
                f"backend='triton' needs the triton package and tritonspec.kernels.triton_ops ({e}); "
                "install with `pip install 'tritonspec[triton]'` or use backend='torch'"
            ) from e
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError(
                "backend='triton' on a machine without CUDA needs TRITON_INTERPRET=1 set before triton is "
                "imported (slow; for tests), or use backend='torch'"
            )
        return TritonOps()
    raise ValueError(f"unresolved backend {backend!r}")
