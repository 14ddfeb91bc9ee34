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

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .rope import Rope, rope_parameters
from .target import default_aux_layer_ids
from .weights import load_state_dict, read_config

FORMATS = ("eagle3", "speculators")


@dataclass
class DrafterConfig:
    """Shape and switches of an EAGLE-3 drafter (names as in the checkpoint config)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    aux_layer_ids: tuple[int, ...] | None = None  # boundary convention; None = (2, N//2, N-3)
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive (as in speculators); set one")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} is larger than the target vocabulary {self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
            if len(self.aux_layer_ids) != self.num_aux_hidden_states:
                raise ValueError(f"{len(self.aux_layer_ids)} aux layer ids {list(self.aux_layer_ids)} but "
                                 f"num_aux_hidden_states={self.num_aux_hidden_states}")

    def hf_config(self) -> Any:
        """A transformers ``LlamaConfig`` carrying the rope settings (for rope init functions)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope.get("rope_theta", 10000.0), rope_scaling=_legacy_rope_scaling(self.rope),
        )


def _legacy_rope_scaling(rope: dict) -> dict | None:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling


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
        self.fc = nn.Linear(c.num_aux_hidden_states * c.target_hidden_size, c.hidden_size, bias=False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(_Norm(c.target_hidden_size) for _ in range(c.num_aux_hidden_states))
        if c.norm_before_fc:
            self.input_norm = _Norm(c.num_aux_hidden_states * c.target_hidden_size)
        self.midlayer = _MidLayer(c)
        self.norm = _Norm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size == c.vocab_size
                             else torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # the target's, unless the checkpoint has its own
        self.has_own_embedding = False
        self.target_info: dict | None = None  # max_position_embeddings / rope of the target, for export checks
        self._rope: Rope | None = None
        # diagnostics (runtime/drift.py): when True, each step also stores its attention probabilities
        # [B, Hq, Q, S] in ``last_attention``; an extra computation that never changes the outputs
        self.capture_attention = False
        self.last_attention: torch.Tensor | None = None

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
    ) -> "Eagle3Drafter":
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
            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
            rope=rope_parameters(tc),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n),
            fc_norm=fc_norm,
            norm_output=norm_output,
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
        )
        d = cls(cfg)
        d.target_info = _target_info(tc)
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

    # ------------------------------------------------------------------ math
    def fc_norm_weight(self) -> torch.Tensor | None:
        """``[n_aux, H_t]`` stacked fc_norm weights, or None when fc_norm is off."""
        return torch.stack([n.weight for n in self.fc_norm]) if self.config.fc_norm else None

    def combine(self, ops: Any, aux: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``fc(norms(aux[index]))``: aux ``[n_src, n_aux*H_t]``, index ``[n]`` (-1 = zero row) -> ``[n, H]``."""
        x = ops.aux_gather(aux, index, self.fc_norm_weight(), self.config.rms_norm_eps)
        if self.config.norm_before_fc:
            x = ops.rms_norm(x, self.input_norm.weight, self.config.rms_norm_eps)
        return F.linear(x, self.fc.weight)

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
        ops: Any,
        hidden: torch.Tensor,  # [B, Q, H] fused target features or the previous step's carry
        tokens: torch.Tensor,  # [B, Q] int64 target-vocabulary ids
        positions: torch.Tensor,  # [B, Q] int64
        k_cache: torch.Tensor,  # [B_max, S+1, Hkv, D]
        v_cache: torch.Tensor,  # [B_max, S+1, Hkv, D]
        slots: torch.Tensor,  # [B, Q] int64, -1 = write nowhere
        prefix_lens: torch.Tensor,  # [B] int64
        tree_mask: torch.Tensor,  # [B, Q, T] bool
        kv_len: int | None = None,
        prefill: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter step; returns ``(hn [B, Q, H] (for logits), carry [B, Q, H])``.

        ``prefill=True``: empty prefix and a causal mask over left-aligned rows, so attention runs
        causally over the new K/V (``ops.prefill_attention``), as ``TargetModel.forward`` does."""
        if self.embed_tokens is None:
            raise RuntimeError("the drafter has no embedding: attach the target's with attach_target_embedding()")
        c, m = self.config, self.midlayer
        eps = c.rms_norm_eps
        B, Q, _ = hidden.shape
        ops.begin_forward()
        e = ops.rms_norm(self.embed_tokens(tokens).to(hidden.dtype), m.input_layernorm.weight, eps)
        v = ops.rms_norm(hidden, m.hidden_norm.weight, eps)
        z = torch.cat([e, v], dim=-1)  # [B, Q, 2H]: embedding first, hidden second
        a = m.self_attn
        q = F.linear(z, a.q_proj.weight).view(B, Q, c.num_attention_heads, c.head_dim)
        k = F.linear(z, a.k_proj.weight).view(B, Q, c.num_key_value_heads, c.head_dim)
        val = F.linear(z, a.v_proj.weight).view(B, Q, c.num_key_value_heads, c.head_dim)
        rope = self.rope()
        tables = rope.tables(positions)  # gathered once for q and k
        q, k = rope.apply(q, tables), rope.apply(k, tables)
        ops.kv_write(k_cache, v_cache, slots, k, val)
        if prefill:
            o = ops.prefill_attention(q, k, val, c.head_dim ** -0.5)
        else:
            o = ops.tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, c.head_dim ** -0.5, kv_len)
        if self.capture_attention:
            self.last_attention = _attention_probs(q, k_cache, prefix_lens, tree_mask, c.head_dim ** -0.5, kv_len)
        o = F.linear(o.reshape(B, Q, -1), a.o_proj.weight)
        x, r = ops.rms_norm(o, m.post_attention_layernorm.weight, eps, residual=v if c.norm_before_residual else hidden)
        h = r + F.linear(F.silu(F.linear(x, m.mlp.gate_proj.weight)) * F.linear(x, m.mlp.up_proj.weight),
                         m.mlp.down_proj.weight)
        hn = ops.rms_norm(h, self.norm.weight, eps)
        return hn, (hn if c.norm_output else h)

    def logits(self, hn: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., V_d]`` (float32) from the normed hidden state."""
        return F.linear(hn, self.lm_head.weight).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """``[V_d]`` int64: the target id of every draft id (the draft vocabulary, in order)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(cls, path: str | Path, *, aux_layer_convention: str = "auto") -> "Eagle3Drafter":
        """Load an EAGLE-3/3.1 drafter: the official flat format (``midlayer.*``),
        ``LlamaForCausalLMEagle3`` (SpecForge/SGLang) or the speculators format.

        ``aux_layer_convention``: ``"boundary"`` (vLLM), ``"post_layer"`` (SpecForge/TorchSpec,
        +1 on read) or ``"auto"`` (SGLang's rule: post-layer when the first id is 1).
        """
        raw = read_config(path)
        state = load_state_dict(path)
        cfg = _config_from_dict(raw, state, aux_layer_convention, str(path))
        d = cls(cfg)
        state = _canonical_keys(state)
        missing = [k for k in d.state_dict() if k not in state and k not in ("d2t", "t2d")]
        if missing:
            raise KeyError(f"drafter checkpoint {path} lacks {missing}")
        own_embed = state.pop("embed_tokens.weight", None)
        if "d2t" not in state:
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise KeyError(f"drafter checkpoint {path} has draft_vocab_size={cfg.draft_vocab_size} but no d2t")
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        if "t2d" not in state:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
            state["t2d"] = t2d
        unexpected = sorted(set(state) - set(d.state_dict()))
        if unexpected:
            warnings.warn(f"drafter checkpoint {path}: ignoring unknown tensors {unexpected[:8]}", stacklevel=2)
        d.load_state_dict({k: state[k] for k in d.state_dict()}, strict=True)
        if own_embed is not None:  # registered, so it is saved and moved with the drafter
            d.embed_tokens = nn.Embedding.from_pretrained(own_embed.float(), freeze=True)
            d.has_own_embedding = True
        return d

    def save_pretrained(self, path: str | Path, format: str = "eagle3", dtype: torch.dtype | None = None) -> Path:
        """Write a checkpoint vLLM/SGLang load as is, after validating it.

        ``format="eagle3"``: ``LlamaForCausalLMEagle3`` config + flat ``midlayer.*`` tensors.
        ``format="speculators"``: ``Eagle3Speculator`` config + ``layers.0.*`` tensors.
        """
        if format not in FORMATS:
            raise ValueError(f"format={format!r} is not one of {FORMATS}")
        c = self.config
        if c.aux_layer_ids is None:
            raise ValueError("set config.aux_layer_ids before saving: the layers the drafter was trained on must be recorded")
        if self.target_info is not None:
            tmax = self.target_info["max_position_embeddings"]
            if c.max_position_embeddings < tmax:
                raise ValueError(f"max_position_embeddings={c.max_position_embeddings} is below the target's {tmax}; "
                                 "long prompts would be drafted with wrong positions")
            if c.rope != self.target_info["rope"]:
                raise ValueError(f"drafter rope settings {c.rope} differ from the target's {self.target_info['rope']}")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if dtype is not None:
            state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        required = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                    "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"]
        required += [f"fc_norm.{i}.weight" for i in range(c.num_aux_hidden_states)] if c.fc_norm else []
        lacking = [k for k in required if k not in state]
        if lacking:
            raise ValueError(f"refusing to write an incomplete drafter checkpoint: missing {lacking}")
        if format == "speculators":
            state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(_config_to_dict(c, format, dtype or self.fc.weight.dtype), indent=2))
        return out


def _attention_probs(q, k_cache, prefix_lens, tree_mask, scale, kv_len) -> torch.Tensor:
    """The attention probabilities ``[B, Hq, Q, S]`` that ``tree_attention`` applies (float32)."""
    from ..kernels.tree_attention import tree_visibility

    B, _, hq, _ = q.shape
    S = k_cache.shape[1] if kv_len is None else kv_len
    k = k_cache[:B, :S].float()  # [B, S, Hkv, D]
    k = k.repeat_interleave(hq // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), k) * scale
    vis = tree_visibility(prefix_lens, tree_mask, S)[:, None]  # [B, 1, Q, S]
    return scores.masked_fill(~vis, float("-inf")).softmax(-1)


# ---------------------------------------------------------------------- config (de)serialisation
def _target_info(tc: Any) -> dict:
    return {"max_position_embeddings": getattr(tc, "max_position_embeddings", 2048), "rope": rope_parameters(tc)}


def _canonical_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    legacy = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
    for k, v in state.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        elif k.startswith("layers."):
            raise ValueError(f"multi-layer drafters are not supported yet (found {k!r}); use a one-layer EAGLE-3 drafter")
        for old, new in legacy.items():
            if k.startswith(old + "."):
                k = new + k[len(old):]
        if k == "draft_id_to_target_id":
            k = "d2t"
        out[k] = v
    return out


def _config_from_dict(raw: dict, state: dict, convention: str, where: str) -> DrafterConfig:
    spec = raw.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in (raw.get("architectures") or [])
    layer = raw.get("transformer_layer_config", raw) if spec else raw
    eagle = raw.get("eagle_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{where}: multi-layer drafters (num_hidden_layers={layer['num_hidden_layers']}) are not supported yet")
    hidden = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    fc = state.get("fc.weight", state.get("model.fc.weight"))
    if fc is None:
        raise KeyError(f"drafter checkpoint {where} has no fc.weight: is it an EAGLE-3 drafter?")
    target_hidden = raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    n_aux = raw.get("num_aux_hidden_states")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if n_aux is None:
        n_aux = len(ids) if ids else fc.shape[1] // target_hidden
    if fc.shape[1] != n_aux * target_hidden:
        raise ValueError(f"{where}: fc.weight takes {fc.shape[1]} inputs but {n_aux} aux states of target_hidden_size "
                         f"{target_hidden} make {n_aux * target_hidden}")
    if ids is not None:
        if convention not in ("auto", "boundary", "post_layer"):
            raise ValueError(f"aux_layer_convention={convention!r}: use 'auto', 'boundary' or 'post_layer'")
        if convention == "auto" and (raw.get("tritonspec") or {}).get("aux_layer_convention") == "boundary":
            convention = "boundary"  # written by us: no guessing
        post = convention == "post_layer" or (convention == "auto" and int(ids[0]) == 1)
        if post and convention == "auto":
            warnings.warn(f"{where}: aux layer ids {ids} start at 1, read as post-layer ids (+1, SGLang's rule); "
                          "pass aux_layer_convention='boundary' if they are boundary ids", stacklevel=3)
        ids = tuple(int(i) + 1 for i in ids) if post else tuple(int(i) for i in ids)
    rope = rope_parameters(_Obj(layer))
    fc_norm = bool(raw.get("fc_norm", raw.get("use_aux_norm", eagle.get("fc_norm", False))))
    norm_output = bool(raw.get("norm_output", eagle.get("norm_output", eagle.get("return_hidden_post_norm", False))))
    vocab = layer.get("vocab_size", raw.get("vocab_size"))
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or hidden // heads,
        vocab_size=vocab,
        draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        target_hidden_size=target_hidden,
        num_aux_hidden_states=n_aux,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        rope=rope,
        aux_layer_ids=ids,
        fc_norm=fc_norm,
        norm_output=norm_output,
        norm_before_fc=bool(raw.get("norm_before_fc", eagle.get("norm_before_fc", False))),
        norm_before_residual=bool(raw.get("norm_before_residual", spec)),
        bos_token_id=layer.get("bos_token_id"),
        eos_token_id=layer.get("eos_token_id"),
    )


class _Obj:
    def __init__(self, d: dict):
        self.__dict__.update(d)


def _config_to_dict(c: DrafterConfig, format: str, dtype: torch.dtype) -> dict:
    layer = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope.get("rope_theta", 10000.0),
        "rope_scaling": _legacy_rope_scaling(c.rope),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
    }
    flags = {
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "num_aux_hidden_states": c.num_aux_hidden_states,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "norm_before_fc": c.norm_before_fc,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
    }
    if format == "eagle3":
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            **flags,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True,
                             "fc_norm": c.fc_norm, "norm_output": c.norm_output, "norm_before_fc": c.norm_before_fc},
            "tritonspec": {"aux_layer_convention": "boundary", "config": asdict(c) | {"aux_layer_ids": list(c.aux_layer_ids)}},
        }
    return {
        "architectures": ["Eagle3Speculator"],
        "model_type": "speculators",
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        **flags,
        "tritonspec": {"aux_layer_convention": "boundary"},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
    }
