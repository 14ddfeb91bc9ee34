"""SwiGLU's gate product on the CPU (``kernels.cpu_norm.silu_mul``, ``kernels/cpu/norm.c``): close to PyTorch's
``F.silu(g) * u`` over odd shapes, strided rows and both dtypes; gate and up not swapped (the inverse check); a
row's values the same in any call (hypothesis); extreme inputs; the torch backend takes it and the demo pair's
greedy output is unchanged end to end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_norm as cn
from tritonspec.runtime.ops import TorchOps

WHY = cl.available(torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"CPU kernels unavailable here: {WHY}")
TOL = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(autouse=True)
def native():
    if not cl._native_ready():
        pytest.skip("the native operator library is not built here (it needs a C++ compiler and torch's headers)")


def _gate_up(rows, inter, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * inter, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1, 15, 16, 17, 384])
@pytest.mark.parametrize("rows", [1, 7, 99])
def test_matches_reference(rows, inter, dtype):
    gu = _gate_up(rows, inter, dtype, seed=rows * 1000 + inter)
    out = cn.silu_mul(gu)
    ref = cn.silu_mul_reference(gu)
    assert out.shape == (rows, inter) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_gate_and_up_are_not_swapped():
    """The inverse: ``silu(up) * gate`` is far from the result, so the comparison above can fail."""
    gu = _gate_up(5, 33, torch.float32)
    g, u = gu.chunk(2, dim=-1)
    out = cn.silu_mul(gu)
    assert not torch.allclose(out, torch.nn.functional.silu(u) * g, atol=1e-2)
    torch.testing.assert_close(out, torch.nn.functional.silu(g) * u, **TOL[torch.float32])


def test_extreme_inputs():
    """Large positive gates pass through (silu(g) = g), large negative ones vanish, zeros stay zero."""
    g = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4])
    gu = torch.cat([g, torch.full_like(g, 3.0)])[None]
    out = cn.silu_mul(gu)[0]
    ref = cn.silu_mul_reference(gu)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-30)
    assert out[8] == 300.0 and out[9].abs() < 1e-30 and out[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_batches(dtype):
    """``[B, Q, 2I]`` views with rows at a padded stride (a deterministic linear's output) give the reference's
    values; a last dim that is not unit-stride is declined (None: the caller runs the reference)."""
    wide = _gate_up(2 * 3, 2 * 40 + 7, dtype).reshape(2, 3, -1)
    gu = wide[..., :80]  # rows at stride 87 * 2, I = 40
    out = cn.silu_mul(gu)
    assert out.shape == (2, 3, 40) and out.is_contiguous()
    torch.testing.assert_close(out, cn.silu_mul_reference(gu), **TOL[dtype])
    assert cn.silu_mul(_gate_up(4, 8, dtype).t()) is None
    assert cn.silu_mul(_gate_up(4, 8, torch.float64)) is None


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), inter=st.integers(1, 70), row=st.integers(0, 69), seed=st.integers(0, 2**16))
def test_a_rows_values_do_not_depend_on_its_call(rows, inter, row, seed):
    """A row alone and the same row inside a batch of any size: the same bits (one instruction sequence per
    element, masked tails included), so speculative and plain decoding agree, in deterministic mode too."""
    row = row % rows
    gu = _gate_up(rows, inter, torch.float32, seed=seed)
    batch = cn.silu_mul(gu)
    alone = cn.silu_mul(gu[row : row + 1].clone())
    assert torch.equal(batch[row : row + 1], alone)


def test_torch_backend_routes_to_it(monkeypatch):
    """``TorchOps.silu_mul`` runs the operator where the CPU kernels run, the reference with ``cpu_linear="torch"``;
    bfloat16 and float32 alike."""
    calls = []
    real = cn.silu_mul
    monkeypatch.setattr(cn, "silu_mul", lambda gu: calls.append(gu.dtype) or real(gu))
    gu = _gate_up(3, 24, torch.float32)
    torch.testing.assert_close(TorchOps().silu_mul(gu), cn.silu_mul_reference(gu), **TOL[torch.float32])
    TorchOps().silu_mul(gu.bfloat16())
    assert calls == [torch.float32, torch.bfloat16]
    assert torch.equal(TorchOps(cpu_linear="torch").silu_mul(gu), cn.silu_mul_reference(gu))
    assert len(calls) == 2


def test_runtime_greedy_output_unchanged(monkeypatch):
    """End to end on the demo pair: the operator or PyTorch's two ops in the target's MLP decode to the same
    greedy tokens, plain and speculative (batch 2, prompts of different lengths)."""
    t, d = ts.demo.demo_pair("eagle3.1")
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cpu", max_batch_size=2)
    prompts = [r["prompt"] for r in ts.demo.prompt_set("standard")[:2]]
    calls = []
    real = cn.silu_mul
    monkeypatch.setattr(cn, "silu_mul", lambda gu: calls.append(1) or real(gu))
    native = rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids
    assert rt.generate(prompts, max_new_tokens=12).token_ids == native
    assert calls
    monkeypatch.setattr(cn, "silu_mul", lambda gu: None)
    assert rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids == native
    assert rt.generate(prompts, max_new_tokens=12).token_ids == native
