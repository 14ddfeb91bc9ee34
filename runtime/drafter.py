"""The EAGLE-3 / EAGLE-3.1 drafter: one module for both, switched by ``fc_norm``/``norm_output``.

Equations (``../shared/reference/eagle-spec.md`` §2.2, §3), with ``A = [a1; a2; a3]`` the
target's residual streams at the aux boundaries:

    combine(A) = W_fc · concat_i RMS_{f_i}(a_i)      fc_norm on (EAGLE-3.1)
               = W_fc · RMS_{in}(A)                   norm_before_fc (one norm over the concat)
               = W_fc · A                             otherwise (EAGLE-3)
    step(u, y):  e = RMS_in(E[y]); v = RMS_hid(u); z = [e; v]          (2H input)
                 r = (v if norm_before_residual else u) + W_o·Attn(z)
                 h = r + MLP(RMS_post(r));  hn = RMS_norm(h)
                 logits = W_lm · hn  (draft vocabulary);  target id = draft id + d2t[draft id]
                 carry  = hn if norm_output else h                     (EAGLE-3.1 vs EAGLE-3)

Both flags off is EAGLE-3 exactly. ``state_dict()`` keys are the flat checkpoint names
(``fc.weight``, ``fc_norm.{i}.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``) read by vLLM and SGLang.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_drafter, cpu_linear
from .checkpoint import FORMATS, read_checkpoint, write_checkpoint
from .deterministic import DeterministicOps
from .drafter_config import DrafterConfig
from .metadata import AttentionMetadata, KVCache
from .ops import TorchOps
from .rope import Rope, rope_parameters
from .target import DEFAULT_MAX_POSITIONS, default_aux_layer_ids, target_info

if TYPE_CHECKING:
    from .ops import Ops

__all__ = ["DrafterConfig", "Eagle3Drafter", "FORMATS"]


class _Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


class _MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size)
        self.hidden_norm = _Norm(c.hidden_size)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _Norm(c.hidden_size)
        self.mlp = _MLP(c)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 / EAGLE-3.1 drafter.

    Examples
    --------
    >>> import tritonspec as ts
    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
    ...                   num_key_value_heads=2, num_hidden_layers=6, vocab_size=100)
    >>> d = ts.Eagle3Drafter.for_target(cfg, fc_norm=True, norm_output=True)
    >>> d.config.aux_layer_ids, d.fc.weight.shape
    ((2, 3, 3), torch.Size([64, 192]))
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        # True when loaded for runtimes only (``from_pretrained(..., loaded_by_runtime=True)``): nobody else
        # holds it, so ``drafter_weight_dtype="auto"`` may repack it in place
        self.loaded_by_runtime = False
        self.fc = nn.Linear(c.num_aux_hidden_states * c.target_hidden_size, c.hidden_size, bias=False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(_Norm(c.target_hidden_size) for _ in range(c.num_aux_hidden_states))
        if c.norm_before_fc:
            self.input_norm = _Norm(c.num_aux_hidden_states * c.target_hidden_size)
        self.midlayer = _MidLayer(c)
        self.norm = _Norm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer(
            "t2d",
            torch.ones(c.vocab_size, dtype=torch.bool)
            if c.draft_vocab_size == c.vocab_size
            else torch.zeros(c.vocab_size, dtype=torch.bool),
        )
        self.embed_tokens: nn.Embedding | None = None  # the target's, unless the checkpoint has its own
        self.has_own_embedding = False
        self.target_info: dict | None = None  # max_position_embeddings / rope of the target, for export checks
        self._rope: Rope | None = None
        self._packed: tuple | None = None  # pack_for_cpu: (sources' versions, {name: packed weight})
        self._round_pack: tuple | None = None  # packed_for_round: (ops, what _cpu_weights gave for them)
        self._round_memo: dict[str, Any] | None = None  # packed_for_round: values fixed for the round (_memo)
        self._fc_norm_stack: tuple | None = None  # fc_norm_weight: (the weights' storage and versions, the stack)
        # pack_for_cpu's weight dtype: None = the drafter's; torch.bfloat16 for a float32 drafter = weight-only
        # bfloat16 panels (kernels.cpu_linear.weight_only_bf16), set by SpeculativeRuntime(drafter_weight_dtype=)
        self.cpu_weight_dtype: torch.dtype | None = None
        self._prompt_pack: dict | None = None  # weight-only bfloat16: the float32 panels a prompt's forward runs
        # decode-round steps on the torch backend's packed CPU weights run as one native operator
        # (kernels/cpu_drafter.py: the same bits); False runs them op by op (its reference)
        self.native_step = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        fc_norm: bool = True,
        norm_output: bool = True,
        draft_vocab_size: int | None = None,
        aux_layer_ids: tuple[int, ...] | list[int] | None = None,
        seed: int = 0,
        intermediate_size: int | None = None,
    ) -> Eagle3Drafter:
        """A fresh, seeded drafter shaped for a target (a transformers config or a model directory).

        The drafter copies the target's hidden size, heads, rope settings and
        ``max_position_embeddings``; ``aux_layer_ids`` defaults to (2, N//2, N-3).
        """
        if isinstance(target_config, (str, Path)):
            from transformers import AutoConfig

            target_config = AutoConfig.from_pretrained(str(target_config))
        tc = target_config
        n = tc.num_hidden_layers
        heads = tc.num_attention_heads
        cfg = DrafterConfig(
            hidden_size=tc.hidden_size,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size or tc.vocab_size,
            target_hidden_size=tc.hidden_size,
            rms_norm_eps=tc.rms_norm_eps,
            max_position_embeddings=getattr(tc, "max_position_embeddings", DEFAULT_MAX_POSITIONS),
            rope=rope_parameters(tc),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n),
            fc_norm=fc_norm,
            norm_output=norm_output,
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
        )
        d = cls(cfg)
        d.target_info = target_info(tc)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in d.named_parameters():
                if name.endswith("proj.weight") or name in ("fc.weight", "lm_head.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        if cfg.draft_vocab_size == cfg.vocab_size:
            d.t2d.fill_(True)
        else:  # until trained on data (d2t/t2d from token frequencies), the lowest ids
            d.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
        return d

    def set_draft_vocab(self, used_ids: torch.Tensor) -> None:
        """Set ``d2t``/``t2d`` from the sorted target ids the draft vocabulary covers."""
        used = torch.as_tensor(used_ids, dtype=torch.int64).sort().values
        if used.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{used.numel()} ids given for draft_vocab_size={self.config.draft_vocab_size}")
        if used.numel() and (used[0] < 0 or used[-1] >= self.config.vocab_size):
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        self.d2t.copy_(used - torch.arange(used.numel()))
        self.t2d.zero_()
        self.t2d[used] = True

    def converted(self, device: torch.device, dtype: torch.dtype) -> Eagle3Drafter:
        """A copy of this drafter on ``device`` in ``dtype``, leaving this one as it is (what a
        runtime runs when the caller's drafter sits elsewhere: modules shared between runtimes are
        never moved under another runtime). A borrowed target embedding is not copied: attach one."""
        # deepcopy returns memo[id(x)]: the caches are not copied
        memo: dict[int, Any] = {id(x): None for x in (self._rope, self._packed, self._prompt_pack)}
        if self.embed_tokens is not None and not self.has_own_embedding:
            memo[id(self.embed_tokens)] = None
        return copy.deepcopy(self, memo).to(device=device, dtype=dtype)

    def attach_target_embedding(self, embed: torch.Tensor, target_info: dict | None = None) -> None:
        """Use the target's embedding table when the checkpoint has none (shared, not copied)."""
        if target_info is not None:
            self.target_info = target_info
        if self.has_own_embedding:
            return
        if embed.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"the drafter has no embedding and its hidden size {self.config.hidden_size} differs from the "
                f"target embedding width {embed.shape[1]}; use a checkpoint that ships embed_tokens.weight"
            )
        # a plain attribute, not a submodule: the target's table is shared, never saved or moved
        object.__setattr__(self, "embed_tokens", nn.Embedding.from_pretrained(embed, freeze=True))

    # ------------------------------------------------------------------ CPU inference weights
    def _pack_sources(self) -> dict[str, list[torch.Tensor]]:
        a, m = self.midlayer.self_attn, self.midlayer.mlp
        return {
            "fc": [self.fc.weight],
            "qkv": [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
            "o": [a.o_proj.weight],
            "gate_up": [m.gate_proj.weight, m.up_proj.weight],
            "down": [m.down_proj.weight],
            "head": [self.lm_head.weight],
        }

    def _versions(self) -> tuple:
        # an inference tensor (loaded under torch.inference_mode) keeps no version counter: 0
        return tuple(
            (0 if w.is_inference() else w._version, w.data_ptr()) for ws in self._pack_sources().values() for w in ws
        )

    def pack_for_cpu(self, enable: bool = True) -> None:
        """Keep a packed copy of the projection weights for the CPU kernel (``kernels.cpu_linear.pack_panels``:
        float32 or bfloat16 16-column panels, the target's ``weight_layout="panels"``), q/k/v and gate/up fused
        into one weight each, used by ``step``, ``combine`` and ``logits`` while autograd is off; a
        weight ``cpu_linear.panels_pay`` declines (N % 16 != 0; small ones on Intel) stays ``[N, K]``.
        On the kernel each output's bits are those of the same weight packed alone (it computes every
        output on its own), so fusing changes none. Only backends whose ``ops.packs_cpu_weights`` holds the
        dtype (the torch backend where the CPU kernels run, for the dtypes ``cpu_linear.panels_default``
        packs) use it, so a runtime with
        ``cpu_linear="torch"`` sharing this module keeps ``F.linear`` on its weights; the runtime
        packs when it attaches the drafter. ``enable=False`` drops the copy.

        Staleness: a weight changed in place (its version counter moves) or replaced is repacked at
        the next eager drafter call (in a runtime's eager round: at the round's start,
        ``packed_for_round``) and before every captured or compiled round
        (``refresh_cpu_pack``), into the same tensors where the shapes allow, so captured rounds read
        the new values. Writes that bypass the version counter (``p.data.copy_(...)``, weights
        loaded as inference tensors and changed under ``torch.inference_mode``) are not seen: call
        ``pack_for_cpu()`` after them."""
        if not enable:
            self._packed = self._prompt_pack = None
            return
        old = self._packed[1] if self._packed is not None else {}
        packed, prompt = {}, {}
        # normal tensors even when the runtime's inference_mode is on (deterministic mode reads their versions)
        with torch.inference_mode(False), torch.no_grad():
            for name, ws in self._pack_sources().items():
                w = (torch.cat(ws) if len(ws) > 1 else ws[0]).detach()
                new = cpu_linear.pack_panels(w) if cpu_linear.panels_pay(w) else w.contiguous().clone()
                if self.weight_only_bf16:
                    if name != "head":  # a prompt's head runs on its last row only: the decode weights serve
                        prompt[name] = new
                    new = cpu_linear.weight_only_bf16(w) if cpu_linear.panels_pay(w) else new
                was = old.get(name)
                if was is not None and was.shape == new.shape and was.dtype == new.dtype and not was.is_inference():
                    was.copy_(new)  # in place: a captured round keeps reading this tensor
                    new = was
                packed[name] = new
        self._packed = (self._versions(), packed)
        self._prompt_pack = prompt or None

    def refresh_cpu_pack(self) -> None:
        """Repack the ``pack_for_cpu`` copy if a weight changed since (eager; the runtime calls it
        before each captured or compiled round); nothing when there is no copy."""
        if self._packed is not None and self._packed[0] != self._versions():
            self.pack_for_cpu()

    def cpu_pack_tensors(self) -> list[torch.Tensor]:
        """The packed copies a captured round reads (empty without ``pack_for_cpu``)."""
        return [] if self._packed is None else list(self._packed[1].values())

    def packs_on(self, ops: Any) -> bool:
        """Whether ``ops`` runs this drafter's projections packed (``pack_for_cpu``): CPU weights of a dtype
        its backend packs (``ops.packs_cpu_weights``; backends without it never pack)."""
        w = self.fc.weight
        return w.is_cpu and w.dtype in getattr(ops, "packs_cpu_weights", ())

    @property
    def weight_only_bf16(self) -> bool:
        """Whether ``pack_for_cpu`` rounds this float32 drafter's packed weights to bfloat16
        (``cpu_weight_dtype``; ``kernels.cpu_linear.weight_only_bf16``): float32 activations on half the
        weight bytes in decode rounds; a prompt's forward keeps the float32 weights (``_cpu_weights``)."""
        return self.cpu_weight_dtype == torch.bfloat16 and self.fc.weight.dtype == torch.float32

    def _cpu_weights(self, ops: Any, prompt: bool = False) -> dict[str, torch.Tensor] | None:
        """The ``pack_for_cpu`` weights when they apply (``packs_on(ops)``, autograd off), packed on first
        use and again when stale. ``prompt``: a prompt's forward (hundreds of rows), where weight-only
        bfloat16 panels run slower than float32 ones (``kernels/cpu/linear.c``): with ``weight_only_bf16``
        it gets float32 panels, so prompts run as without it."""
        rp = self._round_pack
        if rp is not None and rp[0] is ops and not torch.is_grad_enabled() and not prompt:
            return rp[1]  # inside packed_for_round: decided once for the round
        if not self.packs_on(ops) or torch.is_grad_enabled():
            return None
        if self._packed is None:
            self.pack_for_cpu()
        elif not torch.compiler.is_compiling():
            self.refresh_cpu_pack()
        return self._prompt_pack if prompt and self._prompt_pack is not None else self._packed[1]

    @contextlib.contextmanager
    def packed_for_round(self, ops: Any) -> Iterator[None]:
        """Inside the block, ``ops``'s packed weights (``_cpu_weights``: ``packs_on``, staleness) are
        decided once, on entry, instead of at each drafter call: an eager decode round makes ~9 of them
        (steps, heads, the catch-up's fc), and the check walked the module at ~40 us a call (0.36 ms of
        a 9 ms demo round, 2026-12-04). Weights do not change inside a round; one changed between
        rounds is repacked at the next round's entry, as before."""
        prev, prev_memo = self._round_pack, self._round_memo
        self._round_pack = self._round_memo = None
        try:
            self._round_pack = (ops, self._cpu_weights(ops))
            self._round_memo = {}
            yield
        finally:
            self._round_pack, self._round_memo = prev, prev_memo

    def _memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, kept for the rest of the round inside ``packed_for_round`` (autograd off): the native
        operators' arguments (``_native_layer``, asked for by the steps, the draft and the catch-up) walk the
        module. Outside a round, or with autograd on (training), made at every call."""
        memo = self._round_memo
        if memo is None or torch.is_grad_enabled():
            return make()
        out = memo.get(key)
        if out is None:
            out = memo[key] = make()
        return out

    # ------------------------------------------------------------------ math
    def fc_norm_weight(self) -> torch.Tensor | None:
        """``[n_aux, H_t]`` stacked fc_norm weights, or None when fc_norm is off. The stack is kept while no
        weight changed (the same storage, the same version counter: an in-place update or a replaced tensor
        makes a new one); made afresh with autograd on."""
        if not self.config.fc_norm:
            return None
        ws = [n.weight for n in self.fc_norm]
        if torch.is_grad_enabled():
            return torch.stack(ws)
        # an inference tensor keeps no version counter: 0, as in _versions
        key = tuple((w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype, w.device) for w in ws)
        cached = self._fc_norm_stack
        if cached is None or cached[0] != key:
            cached = self._fc_norm_stack = (key, torch.stack(ws))
        return cached[1]

    def combine(self, ops: Any, aux: torch.Tensor, index: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """``fc(norms(aux[index]))``: aux ``[n_src, n_aux*H_t]``, index ``[n]`` (-1 = zero row) -> ``[n, H]``;
        ``prompt``: a prompt's rows (``_cpu_weights``)."""
        x = ops.aux_gather(aux, index, self.fc_norm_weight(), self.config.rms_norm_eps)
        if self.config.norm_before_fc:
            x = ops.rms_norm(x, self.input_norm.weight, self.config.rms_norm_eps)
        packed = self._cpu_weights(ops, prompt)
        return ops.linear(x, self.fc.weight if packed is None else packed["fc"])

    def rope(self, min_positions: int = 0) -> Rope:
        """cos/sin tables on the drafter's device and dtype, covering at least ``min_positions``."""
        w = self.fc.weight
        r = self._rope
        if r is None or r.cos.device != w.device or r.cos.dtype != w.dtype or r.cos.shape[0] < min_positions:
            c = self.config
            n = max(c.max_position_embeddings, min_positions, 0 if r is None else r.cos.shape[0])
            self._rope = Rope(c.hf_config(), c.head_dim, n, w.device, w.dtype)
        return self._rope

    def step(
        self,
        ops: Ops,
        hidden: torch.Tensor,  # [B, Q, H] fused target features or the previous step's carry
        tokens: torch.Tensor,  # [B, Q] int64 target-vocabulary ids
        meta: AttentionMetadata,
        cache: KVCache,  # [B_max, S+1, Hkv, D] each
        keep: torch.Tensor | None = None,  # [B] int64: with meta.prefill, the one row whose output is wanted
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step; returns ``(hn [B, Q, H] (for logits), carry [B, Q, H])``.

        The tokens' K/V go to ``cache`` at ``meta.slots``; ``meta.prefill`` (empty prefix, causal
        mask over left-aligned rows) runs attention causally over the new K/V, as
        ``TargetModel.forward`` does. ``keep`` (prefill only): every row's K/V are written, but
        attention, the output projection and the MLP run for row ``keep[b]`` of each batch row only
        (its query over slots ``[0, keep[b]]``, ``tree_attention``), and ``(hn, carry)`` are
        ``[B, 1, H]``: a prompt's catch-up needs its last position's state and the others' K/V.
        A decode-round step on the torch backend's packed CPU weights runs as one native operator
        (``kernels.cpu_drafter.drafter_step``: the same calls from C++, the same bits) unless
        ``native_step`` is False or the operator declines the inputs."""
        if self.embed_tokens is None:
            raise RuntimeError("the drafter has no embedding: attach the target's with attach_target_embedding()")
        c, m = self.config, self.midlayer
        eps = c.rms_norm_eps
        B, Q, _ = hidden.shape
        if keep is not None and (not meta.prefill or keep.shape != (B,) or keep.dtype != torch.int64):
            raise ValueError(
                f"keep= selects one row of a prompt per batch row: it needs meta.prefill and a [{B}] int64 "
                f"tensor (got prefill={meta.prefill}, {tuple(keep.shape)} {keep.dtype})"
            )
        ops.begin_forward(prompt=meta.prefill)  # a prompt's rows need not round like a decode step's
        packed = self._cpu_weights(ops, meta.prefill)
        if packed is not None and self.native_step and not meta.prefill and self._native_ops(ops) is not None:
            out = cpu_drafter.drafter_step(
                hidden, tokens, self._native_layer(packed), meta.positions, meta.slots, cache.k, cache.v,
                meta.prefix_lens, meta.tree_mask, meta.kv_len,
            )  # fmt: skip
            if out is not None:
                hn, h = out
                return hn, (hn if c.norm_output else h)
        e = ops.rms_norm(self.embed_tokens(tokens).to(hidden.dtype), m.input_layernorm.weight, eps)
        v = ops.rms_norm(hidden, m.hidden_norm.weight, eps)
        z = torch.cat([e, v], dim=-1)  # [B, Q, 2H]: embedding first, hidden second
        a = m.self_attn
        hq, hkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        if packed is None:
            q, k, val = ops.linear(z, a.q_proj.weight), ops.linear(z, a.k_proj.weight), ops.linear(z, a.v_proj.weight)
        else:  # one fused call: each output's bits are those of its own projection
            q, k, val = ops.linear(z, packed["qkv"]).split((hq, hkv, hkv), dim=-1)
            val = val.contiguous()  # kv_write: k's strides
        q = q.view(B, Q, c.num_attention_heads, c.head_dim)
        k = k.view(B, Q, c.num_key_value_heads, c.head_dim)
        val = val.view(B, Q, c.num_key_value_heads, c.head_dim)
        rope = self.rope()
        tables = rope.tables(meta.positions)  # gathered once for q and k
        q, k = ops.rope(q, *tables), ops.rope(k, *tables)
        ops.kv_write(cache.k, cache.v, meta.slots, k, val)
        if keep is not None:
            q, hidden, v = (
                t.gather(1, keep.reshape(B, 1, *([1] * (t.dim() - 2))).expand(B, 1, *t.shape[2:]))
                for t in (q, hidden, v)
            )
            Q = 1  # the row's query over the prompt's slots [0, keep] (written above): prefix keep, one tree slot
            mask = torch.ones(B, 1, 1, dtype=torch.bool, device=q.device)
            o = ops.tree_attention(q, cache.k, cache.v, keep, mask, c.head_dim**-0.5, meta.kv_len)
        elif meta.prefill:
            o = ops.prefill_attention(q, k, val, c.head_dim**-0.5)
        else:
            o = ops.tree_attention(q, cache.k, cache.v, meta.prefix_lens, meta.tree_mask, c.head_dim**-0.5, meta.kv_len)
        o = ops.linear(o.reshape(B, Q, -1), a.o_proj.weight if packed is None else packed["o"])
        x, r = ops.rms_norm(o, m.post_attention_layernorm.weight, eps, residual=v if c.norm_before_residual else hidden)
        if packed is None:
            gate, up = ops.linear(x, m.mlp.gate_proj.weight), ops.linear(x, m.mlp.up_proj.weight)
            h = r + ops.linear(F.silu(gate) * up, m.mlp.down_proj.weight)
        else:
            gate, up = ops.linear(x, packed["gate_up"]).chunk(2, dim=-1)
            h = r + ops.linear(F.silu(gate) * up, packed["down"])
        hn = ops.rms_norm(h, self.norm.weight, eps)
        return hn, (hn if c.norm_output else h)

    def native_chain(
        self,
        ops: Any,
        hn: torch.Tensor,  # [B, H] the catch-up's normed state (depth 1's logits)
        carry: torch.Tensor,  # [B, H] its carried state
        prefix_lens: torch.Tensor,  # [B] int64: the committed lengths L
        active: torch.Tensor,  # [B] bool: rows that write K/V
        cache: KVCache,
        n: int,
        kv_len: int | None,
    ) -> torch.Tensor | None:  # [B, n] int64 target ids
        """The greedy top-1 chain of ``n`` tokens as one native operator (``kernels.cpu_drafter.draft_chain``):
        the tokens ``Decoder.draft_chain`` picks with the tree's top-1 (greedy log q, ``topk``), bit for bit.
        None where a decode step would not run natively (``step``: packed CPU weights, ``native_step``, the
        torch backend) or the operator declines; the caller then runs its Python loop."""
        layer = self._native_ready(ops)
        if layer is None:
            return None
        return cpu_drafter.draft_chain(hn, carry, layer, self.d2t, prefix_lens, active, cache.k, cache.v, kv_len, n)

    def native_sampled_chain(
        self,
        ops: Any,
        hn: torch.Tensor,  # [B, H]
        carry: torch.Tensor,  # [B, H]
        prefix_lens: torch.Tensor,  # [B] int64
        active: torch.Tensor,  # [B] bool
        cache: KVCache,
        n: int,
        kv_len: int | None,
        xi: torch.Tensor,  # [B, n, Vd] Exp(1) noise
        temperature: float,
        vocab: int,  # the target's vocabulary size V
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (target ids [B, n], q [B, n, V])
        """A sampled chain of ``n`` tokens (temperature only) as one native operator
        (``kernels.cpu_drafter.draft_chain_sampled``): ``Decoder._draft_sampled_chain``'s tokens and draft
        distributions q (in the target's vocabulary), bit for bit. None where ``native_chain`` would not run or the
        operator declines."""
        layer = self._native_ready(ops)
        if layer is None:
            return None
        return cpu_drafter.draft_chain_sampled(
            hn, carry, layer, self.d2t, prefix_lens, active, cache.k, cache.v, kv_len, n, xi, temperature, vocab
        )

    def native_tree(
        self,
        ops: Any,
        hn: torch.Tensor,  # [B, H]
        carry: torch.Tensor,  # [B, H]
        prefix_lens: torch.Tensor,  # [B] int64
        active: torch.Tensor,  # [B] bool
        root: torch.Tensor,  # [B] int64
        cache: KVCache,
        K: int,
        D: int,
        N: int,
        kv_len: int | None,
    ) -> tuple[torch.Tensor, ...] | None:  # (node_tokens, parents, depth, mask)
        """The greedy EAGLE-2 tree of ``top_k = K > 1`` as one native operator (``kernels.cpu_drafter.draft_tree``):
        the tree ``Decoder.draft`` expands in Python, the same one. None where a decode step would not run
        natively (``native_chain``'s conditions) or the operator declines."""
        layer = self._native_ready(ops)
        if layer is None:
            return None
        return cpu_drafter.draft_tree(
            hn, carry, layer, self.d2t, prefix_lens, active, root, cache.k, cache.v, kv_len, K, D, N
        )

    def native_catch_up(
        self,
        ops: Any,
        aux: torch.Tensor,  # [B * N, n_aux * H_t]
        nodes: torch.Tensor,  # [B, W] int64
        emitted: torch.Tensor,  # [B, W] int64
        num: torch.Tensor,  # [B] int64
        active: torch.Tensor,  # [B] bool
        prefix_lens: torch.Tensor,  # [B] int64
        N: int,
        qc: int,
        cache: KVCache,
        hn_out: torch.Tensor,  # [B, H]
        carry_out: torch.Tensor,  # [B, H]
        kv_len: int | None,
    ) -> bool:
        """A decode round's catch-up (``Decoder._catch_up``: ``combine`` then ``step`` over the accepted path,
        each row's state at its last position written to ``hn_out``/``carry_out``) as one native operator
        (``kernels.cpu_drafter.catch_up``), the same bits. False where ``step`` would not run natively or the
        operator declines: the caller then runs the Python catch-up."""
        layer = self._native_ready(ops)
        if layer is None:
            return False
        fc_in = self.input_norm.weight if self.config.norm_before_fc else None
        return cpu_drafter.catch_up(
            aux, nodes, emitted, num, active, prefix_lens, N, qc, layer, self.fc_norm_weight(), fc_in, cache.k,
            cache.v, hn_out, carry_out, kv_len,
        )  # fmt: skip

    def _native_ready(self, ops: Any) -> cpu_drafter.DrafterLayer | None:
        """``_native_layer`` where the native drafter operators may run (``native_chain``, ``native_tree``,
        ``native_catch_up``): packed CPU weights, ``native_step``, the torch backend itself (``_native_ops``), an
        attached embedding; else None."""
        packed = self._cpu_weights(ops)
        if packed is None or not self.native_step or self._native_ops(ops) is None or self.embed_tokens is None:
            return None
        return self._native_layer(packed)

    def _native_ops(self, ops: Any) -> TorchOps | None:
        """The torch backend's ops where the native drafter operators compute what ``ops`` would: the backend
        itself (not a subclass or a proxy that watches its calls), or deterministic mode's where every op of the
        drafter's step is probed as its row-invariant kernel (``DeterministicOps.native_drafter_ops``)."""
        if type(ops) is DeterministicOps:
            ops = ops.native_drafter_ops(self)
        return ops if type(ops) is TorchOps else None

    def _native_layer(self, packed: dict[str, torch.Tensor]) -> cpu_drafter.DrafterLayer:
        """The native operators' drafter arguments (``kernels.cpu_drafter.DrafterLayer``): ``packed`` with the
        embedding, the four norms' weights, the rope tables, eps, the attention scale, the head counts and the
        two residual switches; kept for the round (``_memo``) while ``packed`` is the same object."""
        got = self._memo("native_layer", lambda: self._make_native_layer(packed))
        return got if got.packed is packed else self._make_native_layer(packed)

    def _make_native_layer(self, packed: dict[str, torch.Tensor]) -> cpu_drafter.DrafterLayer:
        c, m = self.config, self.midlayer
        rope = self.rope()
        norms = (m.input_layernorm.weight, m.hidden_norm.weight, m.post_attention_layernorm.weight, self.norm.weight)
        return cpu_drafter.DrafterLayer(
            self.embed_tokens.weight, norms, packed, rope.cos, rope.sin, c.rms_norm_eps, c.head_dim**-0.5,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.norm_before_residual, c.norm_output,
        )  # fmt: skip

    def logits(self, hn: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., V_d]`` (float32) from the normed hidden state; ``ops``:
        the backend whose ``linear`` runs the head (default ``F.linear``)."""
        packed = self._cpu_weights(ops)
        w = self.lm_head.weight if packed is None else packed["head"]
        return (ops.linear if ops is not None else F.linear)(hn, w).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """``[V_d]`` int64: the target id of every draft id (the draft vocabulary, in order)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, aux_layer_convention: str = "auto", loaded_by_runtime: bool = False
    ) -> Eagle3Drafter:
        """Load an EAGLE-3/3.1 drafter: the official flat format (``midlayer.*``),
        ``LlamaForCausalLMEagle3`` (SpecForge/SGLang) or the speculators format (``runtime/checkpoint.py``).

        ``aux_layer_convention``: ``"boundary"`` (vLLM), ``"post_layer"`` (SpecForge/TorchSpec,
        +1 on read) or ``"auto"`` (SGLang's rule: post-layer when the first id is 1).
        ``loaded_by_runtime``: the module is for runtimes only (the runtime's ``drafter_weight_dtype="auto"``
        then applies to it; a module a caller loads and passes keeps its dtype).
        """
        ck = read_checkpoint(path, aux_layer_convention)
        d = cls(ck.config)
        d.loaded_by_runtime = loaded_by_runtime
        state = ck.state
        missing = [k for k in d.state_dict() if k not in state]
        if missing:
            raise ValueError(f"drafter checkpoint {path} lacks {missing}")
        unexpected = sorted(set(state) - set(d.state_dict()))
        if unexpected:
            warnings.warn(f"drafter checkpoint {path}: ignoring unknown tensors {unexpected[:8]}", stacklevel=2)
        d.load_state_dict({k: state[k] for k in d.state_dict()}, strict=True)
        if ck.embed is not None:  # registered, so it is saved and moved with the drafter
            d.embed_tokens = nn.Embedding.from_pretrained(ck.embed.float(), freeze=True)
            d.has_own_embedding = True
        return d

    def save_pretrained(
        self,
        path: str | Path,
        format: str = "eagle3",
        dtype: torch.dtype | None = None,
        *,
        target: Any = None,
        serving: str | tuple[str, ...] | None = None,
        force: bool = False,
        overwrite: bool | None = None,
    ) -> Path:
        """Write a checkpoint vLLM/SGLang load as is, after validating it (``runtime/checkpoint.py``).

        ``format="eagle3"``: ``LlamaForCausalLMEagle3`` config + flat ``midlayer.*`` tensors.
        ``format="speculators"``: ``Eagle3Speculator`` config + ``layers.0.*`` tensors.
        ``target`` (a model directory, HF id, transformers config or model): fills
        ``verifier.name_or_path``, the rope settings, ``max_position_embeddings`` and, for a
        checkpoint that records none (official EAGLE-3), the aux layer ids (2, N//2, N-3).
        ``serving`` (``"vllm"``, ``"sglang"``, ``"all"``): judge the export against those systems'
        loaders (``runtime/serving.py``), write ``serving_compatibility.md`` next to it, and refuse
        it when a system would load it but ignore a trained feature, unless ``force``.
        ``overwrite``: None replaces a previous drafter's files but refuses a directory holding
        another model; False refuses any non-empty directory; True replaces anything. The files go
        to a temporary directory first and are renamed into place.
        """
        return write_checkpoint(
            path,
            self.config,
            self.state_dict(),
            format=format,
            dtype=dtype,
            default_dtype=self.fc.weight.dtype,
            target_info=self.target_info,
            target=target,
            serving=serving,
            force=force,
            overwrite=overwrite,
        )
