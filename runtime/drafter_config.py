"""``DrafterConfig``: the shape and switches of an EAGLE-3 / EAGLE-3.1 drafter (checkpoint names).

Shared by the module (``runtime/drafter.py``) and the checkpoint formats (``runtime/checkpoint.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import UserError

SIZES = (  # the integer sizes every drafter config must carry, checked on construction
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
)


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
        for name in SIZES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"drafter config {name}={v!r} must be a positive integer")
        if self.fc_norm and self.norm_before_fc:
            raise UserError("fc_norm and norm_before_fc are mutually exclusive (as in speculators); set one")
        if self.draft_vocab_size > self.vocab_size:
            raise UserError(
                f"draft_vocab_size={self.draft_vocab_size} is larger than the target vocabulary {self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
            if len(self.aux_layer_ids) != self.num_aux_hidden_states:
                raise UserError(
                    f"{len(self.aux_layer_ids)} aux layer ids {list(self.aux_layer_ids)} but "
                    f"num_aux_hidden_states={self.num_aux_hidden_states}"
                )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a drafter with this config, flat checkpoint name -> shape (the module's
        ``state_dict``; a checkpoint may add ``embed_tokens.weight`` [vocab_size, hidden_size])."""
        H, Ht, n, hd = self.hidden_size, self.target_hidden_size, self.num_aux_hidden_states, self.head_dim
        q, kv, inter = self.num_attention_heads * hd, self.num_key_value_heads * hd, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, n * Ht)}
        if self.fc_norm:
            shapes.update({f"fc_norm.{i}.weight": (Ht,) for i in range(n)})
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (n * Ht,)
        m = "midlayer."
        shapes.update(
            {
                m + "input_layernorm.weight": (H,),
                m + "hidden_norm.weight": (H,),
                m + "self_attn.q_proj.weight": (q, 2 * H),
                m + "self_attn.k_proj.weight": (kv, 2 * H),
                m + "self_attn.v_proj.weight": (kv, 2 * H),
                m + "self_attn.o_proj.weight": (H, q),
                m + "post_attention_layernorm.weight": (H,),
                m + "mlp.gate_proj.weight": (inter, H),
                m + "mlp.up_proj.weight": (inter, H),
                m + "mlp.down_proj.weight": (H, inter),
                "norm.weight": (H,),
                "lm_head.weight": (self.draft_vocab_size, H),
                "d2t": (self.draft_vocab_size,),
                "t2d": (self.vocab_size,),
            }
        )
        return shapes

    def hf_config(self) -> Any:
        """A transformers ``LlamaConfig`` carrying the rope settings (for rope init functions)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope.get("rope_theta", 10000.0),
            rope_scaling=legacy_rope_scaling(self.rope),
        )


def legacy_rope_scaling(rope: dict) -> dict | None:
    """The transformers ``rope_scaling`` dict of a rope setting (None for default rope)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling
