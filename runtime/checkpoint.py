"""Drafter checkpoints on disk: the three formats tritonspec reads and the two it writes.

Read: the official SafeAILab flat format (``midlayer.*``), ``LlamaForCausalLMEagle3``
(SpecForge/SGLang/vLLM) and the speculators format (``Eagle3Speculator``, ``layers.0.*``).
Written: ``format="eagle3"`` (``LlamaForCausalLMEagle3`` config + flat ``midlayer.*`` tensors) and
``format="speculators"``. Aux layer ids are converted to tritonspec's boundary convention on read
(see ``read_checkpoint``) and written as boundary ids with a ``tritonspec`` marker.

This module works on configs and state dicts only; ``Eagle3Drafter.from_pretrained`` /
``save_pretrained`` (``runtime/drafter.py``) build and unpack the module around it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .drafter_config import DrafterConfig, legacy_rope_scaling
from .rope import rope_parameters
from .weights import load_state_dict, read_config

FORMATS = ("eagle3", "speculators")


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint read from disk: its config, its tensors under the flat names
    (``fc.weight``, ``midlayer.*``, ``d2t``, ``t2d``, ...) and its own embedding table, if any."""

    config: DrafterConfig
    state: dict[str, torch.Tensor]
    embed: torch.Tensor | None


def read_checkpoint(path: str | Path, aux_layer_convention: str = "auto") -> DrafterCheckpoint:
    """Read any supported drafter checkpoint directory (see ``Eagle3Drafter.from_pretrained``)."""
    raw = read_config(path)
    state = load_state_dict(path)
    cfg = _config_from_dict(raw, state, aux_layer_convention, str(path))
    state = _canonical_keys(state)
    embed = state.pop("embed_tokens.weight", None)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"drafter checkpoint {path} has draft_vocab_size={cfg.draft_vocab_size} but no d2t")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
        state["t2d"] = t2d
    return DrafterCheckpoint(cfg, state, embed)


def write_checkpoint(
    path: str | Path,
    config: DrafterConfig,
    state: dict[str, torch.Tensor],
    *,
    format: str,
    dtype: torch.dtype | None,
    default_dtype: torch.dtype,
    target_info: dict | None,
) -> Path:
    """Validate and write a drafter checkpoint that vLLM/SGLang load as is (``format``: eagle3 or
    speculators); ``dtype`` converts the floating tensors (None: as they are, recorded as
    ``default_dtype``); ``target_info`` (max positions and rope of the target) is checked."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}")
    c = config
    if c.aux_layer_ids is None:
        raise ValueError(
            "set config.aux_layer_ids before saving: the layers the drafter was trained on must be recorded"
        )
    if target_info is not None:
        tmax = target_info["max_position_embeddings"]
        if c.max_position_embeddings < tmax:
            raise ValueError(
                f"max_position_embeddings={c.max_position_embeddings} is below the target's {tmax}; "
                "long prompts would be drafted with wrong positions"
            )
        if c.rope != target_info["rope"]:
            raise ValueError(f"drafter rope settings {c.rope} differ from the target's {target_info['rope']}")
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    required = [
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
    ]
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
    (out / "config.json").write_text(json.dumps(_config_to_dict(c, format, dtype or default_dtype), indent=2))
    return out


def _canonical_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    legacy = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
    for k, v in state.items():
        if k.startswith("model."):
            k = k[len("model.") :]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0.") :]
        elif k.startswith("layers."):
            raise ValueError(
                f"multi-layer drafters are not supported yet (found {k!r}); use a one-layer EAGLE-3 drafter"
            )
        for old, new in legacy.items():
            if k.startswith(old + "."):
                k = new + k[len(old) :]
        if k == "draft_id_to_target_id":
            k = "d2t"
        out[k] = v
    return out


def _config_from_dict(raw: dict, state: dict, convention: str, where: str) -> DrafterConfig:
    spec = raw.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in (raw.get("architectures") or [])
    layer = raw.get("transformer_layer_config", raw) if spec else raw
    eagle = raw.get("eagle_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"{where}: multi-layer drafters (num_hidden_layers={layer['num_hidden_layers']}) are not supported yet"
        )
    hidden = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    fc = state.get("fc.weight", state.get("model.fc.weight"))
    if fc is None:
        raise ValueError(f"drafter checkpoint {where} has no fc.weight: is it an EAGLE-3 drafter?")
    target_hidden = raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    n_aux = raw.get("num_aux_hidden_states")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if n_aux is None:
        n_aux = len(ids) if ids else fc.shape[1] // target_hidden
    if fc.shape[1] != n_aux * target_hidden:
        raise ValueError(
            f"{where}: fc.weight takes {fc.shape[1]} inputs but {n_aux} aux states of target_hidden_size "
            f"{target_hidden} make {n_aux * target_hidden}"
        )
    if ids is not None:
        if convention not in ("auto", "boundary", "post_layer"):
            raise ValueError(f"aux_layer_convention={convention!r}: use 'auto', 'boundary' or 'post_layer'")
        if convention == "auto" and (raw.get("tritonspec") or {}).get("aux_layer_convention") == "boundary":
            convention = "boundary"  # written by us: no guessing
        post = convention == "post_layer" or (convention == "auto" and int(ids[0]) == 1)
        if post and convention == "auto":
            warnings.warn(
                f"{where}: aux layer ids {ids} start at 1, read as post-layer ids (+1, SGLang's rule); "
                "pass aux_layer_convention='boundary' if they are boundary ids",
                stacklevel=3,
            )
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
        "rope_scaling": legacy_rope_scaling(c.rope),
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
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
                "use_aux_hidden_state": True,
                "fc_norm": c.fc_norm,
                "norm_output": c.norm_output,
                "norm_before_fc": c.norm_before_fc,
            },
            "tritonspec": {
                "aux_layer_convention": "boundary",
                "config": asdict(c) | {"aux_layer_ids": list(c.aux_layer_ids)},
            },
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
