"""RMSNorm kernel vs its reference (interpreter on a CPU, compiled on a GPU).

Stated bounds (checked below on every drawn input):
  * against a float64 evaluation of the same math (residual add rounded to the input dtype
    first, as the op specifies): at most ``ULP_BOUND`` units in the last place of the output
    dtype (of the input dtype when the weight promotes the output to fp32 — the normalised row
    is rounded to the input dtype before the weight multiply, by design);
  * against the PyTorch reference: at most ``REF_ULP_BOUND`` ULP of the output dtype (the two
    differ only in the summation order of the fp32 sum of squares); the fused residual sum
    ``x + r`` is bit-identical;
  * batch invariance: a row's bits do not depend on how many rows share the launch (1..64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP_BOUND = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}
REF_ULP_BOUND = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}
MANT = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
MIN_EXP = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ulps(out: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|out - ref64| in units of ``dtype``'s ULP at |ref64| (subnormal spacing below the normals)."""
    _, e = torch.frexp(ref64)
    e = (e - 1).clamp(min=MIN_EXP[dtype])
    ulp = torch.ldexp(torch.ones_like(ref64), e - MANT[dtype])
    return (out.double() - ref64).abs() / ulp


def rms64(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = s.double()
    return w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _inputs(rows, hidden, dtype, wdtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype)
    r = (torch.randn(rows, hidden, generator=g) * scale).to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(wdtype)
    return x.to(DEVICE), r.to(DEVICE), w.to(DEVICE)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.sampled_from([1, 2, 7, 33]),
    hidden=st.sampled_from([1, 7, 64, 99, 128, 1000, 4096]),
    dtype=st.sampled_from(DTYPES),
    weight_fp32=st.booleans(),
    residual=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_ulp_bound(rows, hidden, dtype, weight_fp32, residual, scale, eps, seed):
    wdtype = torch.float32 if weight_fp32 else dtype
    x, r, w = _inputs(rows, hidden, dtype, wdtype, scale, seed)
    if residual:
        y, s = rms_norm(x, w, eps, residual=r)
        y_ref, s_ref = rms_norm_reference(x, w, eps, residual=r)
        assert torch.equal(s, s_ref), "fused residual sum must be bit-identical"
    else:
        y = rms_norm(x, w, eps)
        y_ref = rms_norm_reference(x, w, eps)
        s = x
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    ulp_dtype = dtype  # the row is rounded to the input dtype before the weight multiply
    ref64 = rms64(s, w, eps)
    err64 = ulps(y, ref64, ulp_dtype).max().item()
    assert err64 <= ULP_BOUND[dtype], f"{err64} ULP from float64 (bound {ULP_BOUND[dtype]})"
    err_ref = ulps(y, y_ref.double(), ulp_dtype).max().item()
    assert err_ref <= REF_ULP_BOUND[dtype], f"{err_ref} ULP from the torch reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 99, 4096])
def test_rms_norm_batch_invariant(dtype, hidden):
    x, r, w = _inputs(64, hidden, dtype, dtype, 1.0, hidden)
    full, full_s = rms_norm(x, w, 1e-6, residual=r)
    for n in (1, 2, 5, 17, 64):
        part, part_s = rms_norm(x[:n].clone(), w, 1e-6, residual=r[:n].clone())
        assert torch.equal(part, full[:n]) and torch.equal(part_s, full_s[:n])
    for i in (0, 13, 63):  # a row alone, in a fresh (aligned) allocation
        alone = rms_norm(x[i : i + 1].clone(), w, 1e-6)
        assert torch.equal(alone[0], rms_norm(x, w, 1e-6)[i])


def test_rms_norm_shapes_and_strided_rows():
    x, r, w = _inputs(6, 3 * 64, torch.float16, torch.float16, 1.0, 0)
    chunk = x[:, 64:128]  # rows at stride 3H: the fc_norm chunk layout
    assert torch.equal(rms_norm(chunk, w[:64], 1e-6), rms_norm_reference(chunk, w[:64], 1e-6))
    h = torch.randn(2, 1, 64, dtype=torch.float16, device=DEVICE).expand(2, 5, 64)  # broadcast over queries
    r5 = torch.randn(2, 5, 64, dtype=torch.float16, device=DEVICE)
    for a, b in ((h, None), (h, r5), (r5, h)):
        got, want = rms_norm(a, w[:64], 1e-6, b), rms_norm_reference(a, w[:64], 1e-6, b)
        for g_, w_ in zip(got, want) if b is not None else ((got, want),):
            assert torch.equal(g_, w_) and g_.is_contiguous()
    with pytest.raises(ValueError, match="do not merge into two row axes"):
        rms_norm(torch.randn(4, 4, 4, 8, device=DEVICE).transpose(0, 2), torch.ones(8, device=DEVICE), 1e-6)
    x4 = x.view(2, 3, 3, 64)  # [B, T, heads, D] as in q_norm / k_norm
    assert rms_norm(x4, w[:64], 1e-6).shape == (2, 3, 3, 64)
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 3 * 64)


def test_rms_norm_rejects_bad_arguments():
    x, r, w = _inputs(4, 64, torch.float16, torch.float16, 1.0, 0)
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.to(torch.int32), w, 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[:32], 1e-6)
    with pytest.raises(TypeError, match="residual must have dtype"):
        rms_norm(x, w, 1e-6, residual=r.float())
    with pytest.raises(ValueError, match="residual must have shape"):
        rms_norm(x, w, 1e-6, residual=r[:2])
    with pytest.raises(ValueError, match="x must have unit stride"):
        rms_norm(x.t(), w[:4], 1e-6)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, torch.randn(64, 2, dtype=torch.float16, device=DEVICE)[:, 0], 1e-6)
