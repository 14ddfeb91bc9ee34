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
from .store import tuned
from .utils import (
    ENABLE_FP_FUSION,
    FLOAT_DTYPES,
    check_tensor,
    require_triton,
    rms_config,
    rms_normalize,
    round_to,
    tl,
    triton,
)


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


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# Grid (n, n_aux): one program per (output row, H-wide chunk). With fc_norm the chunk goes
# through the same ``utils.rms_normalize`` as the RMSNorm kernel with the same per-H config: under
# the interpreter the fused result is bit-identical to ``rms_norm`` applied to the gathered chunk;
# compiled for a GPU (H200, 2026-12-04) it may differ in the last bit, since the compiler lays the
# two kernels' reductions out differently (the loads' alignment differs). Either kernel gives a row
# the same bits whatever the other rows, which is what the runtime relies on. A padding row
# (index -1, the PAD constexpr) is written as zeros.
# --------------------------------------------------------------------------------------------
def gather_config(hidden: int, dtype: torch.dtype | None = None, device: torch.device | None = None) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of the plain gather (no reduction: any config is bit-exact):
    tuned per chunk width when the store has it, else the RMSNorm heuristic."""
    block, num_warps = rms_config(hidden)
    return block, tuned("aux_gather", hidden, {"num_warps": num_warps}, dtype=dtype, device=device)["num_warps"]


@triton.jit
def _aux_gather_kernel(
    aux_ptr,  # [n_src, n_aux*H] rows at stride_aux, unit stride along the row
    index_ptr,  # [n] int64, PAD = padding row
    w_ptr,  # [n_aux, H] contiguous (read when HAS_NORM)
    out_ptr,  # [n, n_aux*H] contiguous
    stride_aux,
    eps,
    H: tl.constexpr,
    N_AUX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PAD: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    src = tl.load(index_ptr + i)
    valid = src != PAD
    src = tl.where(valid, src, 0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(aux_ptr + src * stride_aux + j * H + cols, mask=cols < tl.where(valid, H, 0), other=0.0)
    if HAS_NORM:
        w = tl.load(w_ptr + j * H + cols, mask=mask, other=0.0)
        y = rms_normalize(x.to(tl.float32), w, H, eps, x.dtype)
        y = round_to(y, out_ptr.dtype.element_ty)
    else:
        y = x
    y = tl.where(valid, y, tl.zeros_like(y))
    tl.store(out_ptr + i * (N_AUX * H) + j * H + cols, y, mask=mask)


def aux_gather(
    aux: torch.Tensor,  # [n_src, n_aux*H]
    index: torch.Tensor,  # [n] int64, -1 = padding row
    fc_norm_weight: torch.Tensor | None,  # [n_aux, H] or None (plain gather)
    eps: float,
    *,
    n_aux: int | None = None,  # chunk count for the plain gather (only sets the launch split)
) -> torch.Tensor:  # [n, n_aux*H]
    """Triton gather (+ fused per-chunk RMSNorm) with ``aux_gather_reference``'s semantics.

    Indices must lie in ``[-1, n_src)``; they are not checked (that would need a host sync).
    """
    require_triton()
    check_tensor("aux", aux, dtypes=FLOAT_DTYPES, ndim=2, contiguous=False)
    if aux.stride(1) != 1 and aux.shape[1] > 1:
        raise ValueError(f"aux must have unit stride along its rows, got strides {aux.stride()}")
    check_tensor("index", index, dtypes=(torch.int64,), ndim=1, device=aux.device)
    width = aux.shape[1]
    if fc_norm_weight is not None:
        check_tensor("fc_norm_weight", fc_norm_weight, dtypes=FLOAT_DTYPES, ndim=2, device=aux.device)
        n_aux, hidden = fc_norm_weight.shape
        if n_aux * hidden != width:
            raise ValueError(
                f"fc_norm_weight shape {tuple(fc_norm_weight.shape)} does not split aux rows of width {width}"
            )
        out_dtype = torch.promote_types(fc_norm_weight.dtype, aux.dtype)
    else:
        n_aux = n_aux or 1
        if width % n_aux:
            raise ValueError(f"n_aux={n_aux} does not divide the aux row width {width}")
        hidden = width // n_aux
        out_dtype = aux.dtype
    out = torch.empty((index.shape[0], width), dtype=out_dtype, device=aux.device)
    if index.shape[0] == 0 or width == 0:
        return out
    if fc_norm_weight is not None:  # the RMSNorm kernel's config: the fused result must equal rms_norm's
        block, num_warps = rms_config(hidden, aux.dtype, aux.device)
    else:
        block, num_warps = gather_config(hidden, aux.dtype, aux.device)
    _aux_gather_kernel[(index.shape[0], n_aux)](
        aux, index, fc_norm_weight if fc_norm_weight is not None else aux, out,
        aux.stride(0), float(eps),
        H=hidden, N_AUX=n_aux, BLOCK_H=block, HAS_NORM=fc_norm_weight is not None, PAD=-1,
        num_warps=num_warps, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return out
