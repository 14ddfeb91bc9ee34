"""Rotary position embeddings, including the ``rope_scaling`` types Llama-3.x checkpoints use.

``inv_freq`` for ``default``, ``linear`` and ``llama3`` is computed here; other static types
(``yarn``, ``longrope``, ...) are delegated to transformers' own init functions so that we
match the oracle. ``dynamic`` scaling depends on the running length and is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels.cpu_rope import rope_reference


def rope_parameters(config: Any) -> dict:
    """The rope settings of a transformers config as one dict (v4 and v5 layouts)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    out.setdefault("rope_type", out.pop("type", "default") if "type" in out else "default")
    return out


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_scaling)`` for a transformers config."""
    p = rope_parameters(config)
    kind = p.get("rope_type", "default")
    base = float(p["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(p["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "dynamic":
        raise ValueError(
            "rope_scaling type 'dynamic' changes with the running length and is not supported; "
            "use a checkpoint with static rope scaling (default, linear, llama3, yarn)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unknown rope_scaling type {kind!r}; supported: default, linear, llama3, "
            f"{', '.join(k for k in ROPE_INIT_FUNCTIONS if k not in ('linear', 'llama3', 'dynamic'))}"
        )
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv.float(), float(scale)


class Rope:
    """cos/sin tables for positions ``0..max_pos-1``; ``apply`` rotates q or k in place of HF's
    ``apply_rotary_pos_emb`` (rotate-half convention)."""

    def __init__(self, config: Any, head_dim: int, max_pos: int, device: torch.device, dtype: torch.dtype):
        inv, scale = rope_inv_freq(config, head_dim)
        t = torch.arange(max_pos, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)  # [max_pos, head_dim]
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, Q, 1, D]`` for positions ``[B, Q]``; gather once per forward."""
        return self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]

    def apply(self, x: torch.Tensor, positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [B, Q, heads, D]; positions: [B, Q] or the (cos, sin) tables from ``tables``
        cos, sin = self.tables(positions) if isinstance(positions, torch.Tensor) else positions
        return rope_reference(x, cos, sin)
