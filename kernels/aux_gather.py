"""Aux-state gather with EAGLE-3.1's per-state RMSNorm (``fc_norm``) fused.

The target captures its residual stream at ``n_aux`` boundaries, concatenated per token into
``aux [n_src, n_aux*H]``. The drafter's fc consumes the rows of accepted tokens:

    out[i] = concat_j  RMS_{w_j}(aux[index[i], j*H:(j+1)*H])      (fc_norm on)
    out[i] = aux[index[i]]                                          (fc_norm off: plain gather)

``index[i] = -1`` marks a padding row: its output is all zeros.
"""
from __future__ import annotations

import torch

from .rms_norm import rms_norm_reference


def aux_gather_reference(
    aux: torch.Tensor,  # [n_src, n_aux*H]
    index: torch.Tensor,  # [n] int64, -1 = padding row
    fc_norm_weight: torch.Tensor | None,  # [n_aux, H] or None (plain gather)
    eps: float,
) -> torch.Tensor:  # [n, n_aux*H]
    """Gather rows of ``aux`` at ``index`` and (optionally) RMS-normalise each H-wide chunk."""
    valid = index >= 0
    rows = aux.index_select(0, index.clamp(min=0))
    if fc_norm_weight is not None:
        n_aux, hidden = fc_norm_weight.shape
        chunks = rows.view(rows.shape[0], n_aux, hidden)
        rows = rms_norm_reference(chunks, fc_norm_weight, eps).reshape(rows.shape[0], n_aux * hidden)
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
