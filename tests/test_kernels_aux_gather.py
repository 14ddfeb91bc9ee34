"""Aux-state gather (+ fused per-chunk fc_norm) kernel vs its reference.

Stated bounds:
  * plain gather (fc_norm off): bit-identical to the reference, padding rows (-1) all zeros;
  * fc_norm on: bit-identical to the RMSNorm kernel applied to each gathered chunk (same
    math, same per-H launch config), hence within the RMSNorm ULP bounds of a float64
    reference (``test_kernels_rms_norm.ULP_BOUND``: 8 ULP fp32, 2 ULP fp16/bf16), and
    bit-identical for a row gathered alone or among 1..64 rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from test_kernels_rms_norm import ULP_BOUND  # noqa: E402  (subnormal-aware ULPs: fp16 below 2^-14)
from test_kernels_rms_norm import ulps as _ulps

from tritonspec.kernels.aux_gather import aux_gather, aux_gather_reference  # noqa: E402
from tritonspec.kernels.rms_norm import rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def gather_case(draw):
    n_src = draw(st.integers(1, 9))
    n = draw(st.integers(1, 12))
    index = draw(st.lists(st.integers(-1, n_src - 1), min_size=n, max_size=n))
    return dict(
        n_src=n_src,
        index=index,
        n_aux=draw(st.sampled_from([1, 2, 3])),
        hidden=draw(st.sampled_from([1, 7, 32, 99, 256])),
        dtype=draw(st.sampled_from(DTYPES)),
        weight_fp32=draw(st.booleans()),
        row_pad=draw(st.sampled_from([0, 5])),  # aux rows inside a wider buffer (strided rows)
        seed=draw(st.integers(0, 2**16)),
    )


def _make(c):
    g = torch.Generator().manual_seed(c["seed"])
    width = c["n_aux"] * c["hidden"]
    buf = torch.randn(c["n_src"], width + c["row_pad"], generator=g).to(c["dtype"]).to(DEVICE)
    aux = buf[:, :width]
    wdtype = torch.float32 if c["weight_fp32"] else c["dtype"]
    w = (1 + 0.3 * torch.randn(c["n_aux"], c["hidden"], generator=g)).to(wdtype).to(DEVICE)
    index = torch.tensor(c["index"], dtype=torch.int64, device=DEVICE)
    return aux, index, w


@settings(max_examples=35, deadline=None)
@given(gather_case())
def test_aux_gather_matches_reference(c):
    aux, index, w = _make(c)
    eps = 1e-6
    # plain gather: bit for bit
    plain = aux_gather(aux, index, None, eps)
    assert torch.equal(plain, aux_gather_reference(aux, index, None, eps))
    plain_split = aux_gather(aux, index, None, eps, n_aux=c["n_aux"])
    assert torch.equal(plain_split, plain)
    # fc_norm on
    out = aux_gather(aux, index, w, eps)
    ref = aux_gather_reference(aux, index, w, eps)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    pad = index < 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert not torch.signbit(out[pad]).any()  # +0.0, like the reference's zeros
    valid = ~pad
    if valid.any():
        rows = aux.index_select(0, index[valid]).view(-1, c["n_aux"], c["hidden"])
        by_kernel = torch.cat([rms_norm(rows[:, j], w[j], eps) for j in range(c["n_aux"])], dim=-1)
        if DEVICE == "cpu":  # the interpreter: bit for bit
            assert torch.equal(out[valid], by_kernel), "fused gather must equal rms_norm on the gathered chunks"
        else:  # compiled, the two kernels' reductions may be laid out differently: within an ulp
            ulp = torch.finfo(out.dtype).eps
            torch.testing.assert_close(out[valid], by_kernel, rtol=2 * ulp, atol=ulp)
        h = rows.double()
        ref64 = (w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).reshape(rows.shape[0], -1)
        err = _ulps(out[valid], ref64, c["dtype"]).max().item()
        assert err <= ULP_BOUND[c["dtype"]], f"{err} ULP from float64"


@pytest.mark.parametrize("dtype", DTYPES)
def test_aux_gather_batch_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    hidden, n_aux = 99, 3
    aux = torch.randn(80, n_aux * hidden, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(n_aux, hidden, generator=g)).to(dtype).to(DEVICE)
    index = torch.randint(-1, 80, (64,), generator=g).to(DEVICE)
    full = aux_gather(aux, index, w, 1e-5)
    for n in (1, 3, 31, 64):
        assert torch.equal(aux_gather(aux, index[:n].clone(), w, 1e-5), full[:n])
    for i in (0, 17, 63):
        assert torch.equal(aux_gather(aux, index[i : i + 1].clone(), w, 1e-5)[0], full[i])


def test_aux_gather_rejects_bad_arguments():
    aux = torch.randn(4, 3 * 16, device=DEVICE)
    w = torch.ones(3, 16, device=DEVICE)
    idx = torch.tensor([0, -1], device=DEVICE)
    with pytest.raises(TypeError, match="index must have dtype"):
        aux_gather(aux, idx.int(), w, 1e-6)
    with pytest.raises(TypeError, match="aux must have dtype"):
        aux_gather(aux.to(torch.int64), idx, w, 1e-6)
    with pytest.raises(ValueError, match="fc_norm_weight shape"):
        aux_gather(aux, idx, torch.ones(2, 16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="aux must have unit stride"):
        aux_gather(torch.randn(3 * 16, 4, device=DEVICE).t(), idx, w, 1e-6)
    with pytest.raises(ValueError, match="index must be 1-D"):
        aux_gather(aux, idx[None], w, 1e-6)
    with pytest.raises(ValueError, match="fc_norm_weight must be contiguous"):
        aux_gather(aux, idx, torch.ones(16, 3, device=DEVICE).t(), 1e-6)
