"""RMSNorm (target and drafter norms, EAGLE-3.1 post-norm feedback).

Math, per row x of width H, with an optional residual r added first:

    s = x + r                      (when r is given; s is returned as the new residual)
    y = w * (s / sqrt(mean(s^2) + eps))

Accumulation is in float32; the normalised row is cast back to the input dtype *before* the
weight multiply, exactly as Hugging Face's ``LlamaRMSNorm`` does, so the torch backend
reproduces transformers bit for bit.
"""
from __future__ import annotations

import torch


def rms_norm_reference(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the last axis; with ``residual``, returns ``(norm(x + residual), x + residual)``."""
    s = x if residual is None else x + residual
    dtype = s.dtype
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(dtype)
    return y if residual is None else (y, s)
