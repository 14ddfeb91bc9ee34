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


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# One program per row; the whole row sits in registers (BLOCK_H = next_pow2(H) <= 65536), so the
# reduction tree is fixed by (H, num_warps) and ``utils.rms_config`` picks both from H alone: a row's
# result never depends on how many rows share the launch (batch invariance, ARCHITECTURE §3).
# Rounding follows the reference step by step: the residual add in the input dtype, sum of
# squares in fp32, mean = sum / H, rstd = 1 / sqrt(mean + eps) (both correctly rounded), the
# normalised row cast to the input dtype, then the weight multiply in fp32 rounded once to the
# output dtype (promote(weight, x), as torch's type promotion gives).
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M1"])
def _rms_norm_kernel(
    x_ptr,  # [M0, M1, H]: row (i, j) at i * stride_x0 + j * stride_x1, unit stride along H
    r_ptr,  # [M0, M1, H] at (stride_r0, stride_r1) (read when HAS_RESIDUAL)
    w_ptr,  # [H]
    y_ptr,  # [M0 * M1, H] contiguous, dtype promote(w, x)
    s_ptr,  # [M0 * M1, H] contiguous, x + r (written when HAS_RESIDUAL)
    M1,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = row // M1
    j = row - i * M1
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        # the add rounds to the input dtype like the reference (fp32 sum, one rounding: exact
        # for fp16/bf16 operands since 24 >= 2 * 11 + 2)
        s = round_to(
            h + tl.load(r_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0).to(tl.float32), DTYPE
        )
        tl.store(s_ptr + row * H + cols, s, mask=mask)
        h = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = rms_normalize(h, w, H, eps, DTYPE)
    tl.store(y_ptr + row * H + cols, round_to(y, y_ptr.dtype.element_ty), mask=mask)


def _row_grid(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[int, int, list[tuple[int, int]]]:
    """The leading axes of tensors of ``shape [..., H]`` as one 2-level row grid, without a copy.

    Adjacent axes merge when every tensor's strides allow it; at most two groups may remain
    (a contiguous ``[B, Q, H]``, a ``[:, k*H:(k+1)*H]`` chunk of a wider row, a hidden state
    expanded over the query axis with stride 0, ...). Returns ``(M0, M1, [(s0, s1) per tensor])``
    or ``None`` when the axes do not fit two groups.
    """
    groups: list[list] = []  # [size, [stride per tensor]], outermost first
    for ax, size in enumerate(shape[:-1]):
        if size == 1:
            continue
        st = [t[ax] for t in strides]
        if groups and all(g == x * size for g, x in zip(groups[-1][1], st)):
            groups[-1] = [groups[-1][0] * size, st]
        else:
            groups.append([size, st])
    if len(groups) > 2:
        return None
    groups = [[1, [0] * len(strides)]] * (2 - len(groups)) + groups
    (m0, s0), (m1, s1) = groups
    return m0, m1, list(zip(s0, s1))


def rms_norm(
    x: torch.Tensor,  # [..., H], unit stride along H
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H], same shape and dtype as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm with the reference's semantics (``rms_norm_reference``); outputs are contiguous."""
    require_triton()
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous=False)
    if x.dim() < 1:
        raise ValueError("x must have at least one axis")
    hidden = x.shape[-1]
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(hidden,), device=x.device)
    if x.stride(-1) != 1 and hidden > 1:
        raise ValueError(f"x must have unit stride along its last axis, got strides {x.stride()}")
    tensors = [x]
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape), contiguous=False, device=x.device)
        if residual.stride(-1) != 1 and hidden > 1:
            raise ValueError(f"residual must have unit stride along its last axis, got strides {residual.stride()}")
        tensors.append(residual)
    grid = _row_grid(tuple(x.shape), *(t.stride() for t in tensors))
    if grid is None:
        names = "x and residual" if residual is not None else "x"
        raise ValueError(
            f"{names}: leading axes (shape {tuple(x.shape)}, strides {[t.stride() for t in tensors]}) do not merge "
            "into two row axes"
        )
    m0, m1, strides = grid
    (sx0, sx1), (sr0, sr1) = strides[0], strides[-1] if residual is not None else (0, 0)
    block, num_warps = rms_config(hidden, x.dtype, x.device)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if m0 * m1 > 0 and hidden > 0:
        _rms_norm_kernel[(m0 * m1,)](
            x, residual if residual is not None else x, weight, y, s,
            m1, sx0, sx1, sr0, sr1, float(eps),
            H=hidden, BLOCK_H=block, HAS_RESIDUAL=residual is not None,
            num_warps=num_warps, enable_fp_fusion=ENABLE_FP_FUSION,
        )  # fmt: skip
    return y if residual is None else (y, s)
