"""bfloat16 weights packed into 16-column panels (``kernels.cpu_linear.pack_panels``, ``weight_layout="panels"``,
the bfloat16 default on AVX2 CPUs without AMX): the kernel is the float32 panel kernel on the widened
values, rounded once to bfloat16, so it equals that computation bit for bit; rows are invariant
whatever shares the call; the rounding is torch's (nearest even); and a bfloat16 target and drafter
in this layout decode losslessly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.target import resolve_layout

WHY = cl.available(torch.bfloat16)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"CPU linear kernel unavailable for bfloat16: {WHY}")
BF = torch.bfloat16


def _widened(x, w, b=None):
    """The float32 panel kernel on the widened values, rounded once: what the bfloat16 kernel computes."""
    y = cl.cpu_linear(x.float(), cl.pack_panels(w.float()), None if b is None else b.float(), threads=1)
    return y.to(BF)


@pytest.mark.parametrize("n", [16, 48, 112])
@pytest.mark.parametrize("k", [1, 7, 99, 577])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_float32_chain_rounded_once(n, k, m, bias):
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    w, x = torch.randn(n, k, generator=g).to(BF), torch.randn(m, k, generator=g).to(BF)
    b = torch.randn(n, generator=g).to(BF) if bias else None
    y = cl.cpu_linear(x, cl.pack_panels(w), b)
    assert y.shape == (m, n) and y.dtype == BF
    assert torch.equal(y, _widened(x, w, b))
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 2**-8 * ref.abs() + 1e-6 * (k + 1) * float(F.linear(x.double().abs(), w.double().abs()).max() + 1)
    assert bool(((y.double() - ref).abs() <= tol).all())  # one bfloat16 rounding of a float32 sum


def test_inverse_the_comparison_sees_another_rounding():
    """The equality above can fail: the ``[N, K]`` bfloat16 kernel (pair products, another order)
    rounds some outputs differently, and so does truncating the same float32 sums instead of
    rounding them to nearest."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(576, 1536, generator=g).to(BF), torch.randn(8, 1536, generator=g).to(BF)
    panels = cl.cpu_linear(x, cl.pack_panels(w))
    assert not torch.equal(panels, cl.cpu_linear(x, w))
    f32 = cl.cpu_linear(x.float(), cl.pack_panels(w.float()))
    truncated = (f32.view(torch.int32) >> 16).to(torch.int16).view(BF)
    assert torch.equal(panels, f32.to(BF)) and not torch.equal(panels, truncated)


def test_rounding_is_nearest_even_with_inf_and_nan():
    """K = 1, x = 1: each output is (+0.0 + w) + b in float32 (the chain starts from +0.0), then the
    kernel's vector rounding: ties to even, overflow to inf, NaN stays NaN; equal to torch's float32 ->
    bfloat16."""
    w = torch.tensor(
        [1.0, 1.0078125, 1.0, -1.0078125, 3.0e38, float("inf"), float("nan"), -0.0]
        + [0.0, 1e-40, -2.5, 65504.0, 1.5, 3.3895e38, -3.3895e38, 7.0],
        dtype=torch.float32,
    )
    b = torch.tensor(
        [2**-8, 2**-8, 2**-9, -(2**-8), 3.0e38, 1.0, 0.0, -0.0]
        + [-0.0, 0.0, 2**-8, 1.0, 2**-7 * 0.5, 0.0, 0.0, -(2**-6)],
        dtype=torch.float32,
    )
    wb, bb = w.to(BF), b.to(BF)
    y = cl.cpu_linear(torch.ones(1, 1, dtype=BF), cl.pack_panels(wb[:, None].contiguous()), bb)[0]
    want = ((torch.zeros(16) + wb.float()) + bb.float()).to(BF)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), (y, want)
    assert y[0] == 1.0 and y[1] == 1.015625 and y[4] == float("inf") and bool(y[6].isnan())


@settings(max_examples=30, deadline=None)
@given(
    panels=st.integers(1, 9),
    k=st.integers(1, 300),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_rows_are_invariant(panels, k, rows, seed, threads):
    """A row's bits do not depend on how many rows share the call, which ones, or the thread count."""
    g = torch.Generator().manual_seed(seed)
    w = cl.pack_panels(torch.randn(16 * panels, k, generator=g).to(BF))
    x, b = torch.randn(rows, k, generator=g).to(BF), torch.randn(16 * panels, generator=g).to(BF)
    full = cl.cpu_linear(x, w, b, threads=1)
    for m in sorted({1, 2, 3, 4, 5, 6, 7, 9, rows}):
        idx = torch.randperm(rows, generator=g)[: min(m, rows)]
        assert torch.equal(cl.cpu_linear(x[idx], w, b, threads=threads), full[idx]), m
    other = (torch.randn(rows, k, generator=g) * 1e3).to(BF)
    other[0] = x[0]
    assert torch.equal(cl.cpu_linear(other, w, b, threads=threads)[0], full[0])


def test_strided_rows_and_many_rows():
    """x rows at a stride (a view), and x copies of every size: the per-thread buffer grown, reused by a
    smaller call, and a call's own buffer above the kept size (2^19 floats)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(64, 200, generator=g).to(BF)
    big = torch.randn(300, 400, generator=g).to(BF)
    x = big[:, 100:300]  # [300, 200] at row stride 400
    wp = cl.pack_panels(w)
    y = cl.cpu_linear(x, wp)
    assert torch.equal(y, _widened(x.contiguous(), w))
    assert torch.equal(cl._launch_ctypes(x, wp, None, None), y)
    assert torch.equal(cl.cpu_linear(x[:3], wp), y[:3])  # the grown buffer, reused
    w2 = torch.randn(16, 1536, generator=g).to(BF)
    x2 = torch.randn(400, 1536, generator=g).to(BF)  # 614,400 floats: the call's own buffer
    assert torch.equal(cl.cpu_linear(x2, cl.pack_panels(w2)), _widened(x2, w2))


def test_pack_roundtrip_slices_and_layout():
    w = torch.randn(48, 33).to(BF)
    wp = cl.pack_panels(w)
    assert wp.shape == (3, 33, 16) and wp.dtype == BF and cl.is_packed(wp)
    assert (cl.out_features(wp), cl.in_features(wp)) == (48, 33)
    assert torch.equal(cl.unpack(wp), w)
    assert torch.equal(cl.unpack(wp[1:2]), w[16:32])
    assert torch.equal(cl.unpack(wp[-1:, :5].contiguous()), w[32:, :5])
    # pairs interleaved: lane j of a k-step holds column j (low half) and column 8 + j (high half)
    assert torch.equal(wp[0, 0, 0::2], w[0:8, 0]) and torch.equal(wp[0, 0, 1::2], w[8:16, 0])
    assert not torch.equal(wp, cl.pack_panels(w.float()).to(BF))  # not the float32 layout
    with pytest.raises(ValueError, match="N % 16"):
        cl.pack_panels(torch.randn(17, 8).to(BF))
    with pytest.raises(ValueError, match="into panels"):
        cl.pack_panels(torch.randn(16, 8).half())


def test_native_operator_and_compiled_call_run_the_same_kernel():
    w, x = cl.pack_panels(torch.randn(64, 99).to(BF)), torch.randn(5, 99).to(BF)
    b = torch.randn(64).to(BF)
    ref = cl._launch_ctypes(x, w, b, None)
    assert torch.equal(cl.cpu_linear(x, w, b), ref)
    if cl.native_op() is None:
        assert torch.equal(torch.ops.tritonspec_cpu.linear(x, w, b, -1), ref)
    fn = torch.compile(lambda a: cl.linear(a, w, b), fullgraph=True)
    assert torch.equal(fn(x), ref)


def test_layout_is_the_bfloat16_default_without_amx():
    cpu = torch.device("cpu")
    want = "amx" if cl.amx_available() is None else "panels" if cl.panels_default(BF) else "nk"
    assert resolve_layout("auto", cpu, BF) == want
    assert resolve_layout("panels", cpu, BF) == "panels"


@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
def test_bfloat16_panels_target_and_drafter_decode_losslessly():
    """The demo pair in bfloat16: the target in panels (every projection packed, the same weights
    written back), the drafter packed at attach where its runtime packs; speculative greedy output
    equals plain greedy output in the same layout, and the nk target's head gives logits within
    bfloat16's rounding of the panels target's."""
    target, drafter = ts.demo.demo_pair()
    tok = ts.runtime.engine.load_tokenizer(target)
    nk = ts.TargetModel.from_pretrained(target, dtype=BF, weight_layout="nk")
    pn = ts.TargetModel.from_pretrained(target, dtype=BF, weight_layout="panels")
    assert pn.layers[0].wqkv.dim() == 3 and pn.layers[0].wqkv.dtype == BF and pn.lm_head.dim() == 3
    a, b = nk.state_dict(), pn.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from tritonspec.runtime import profiles

    assert profiles.target_fingerprint(nk) == profiles.target_fingerprint(pn)  # tuned profiles still apply
    h = torch.randn(3, nk.hidden_size, generator=torch.Generator().manual_seed(1)).to(BF)
    a, b = nk.logits(h).float(), pn.logits(h).float()
    assert torch.allclose(a, b, rtol=2**-7, atol=1e-2) and not torch.equal(a, torch.zeros_like(a))
    d = ts.Eagle3Drafter.from_pretrained(drafter).to(BF)
    rt = ts.SpeculativeRuntime(pn, d, tok, spec=ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6))
    if d.packs_on(rt.ops):
        assert d._packed is not None and any(t.dim() == 3 and t.dtype == BF for t in d.cpu_pack_tensors())
    ids = tok("def add(a, b):\n    return a + b\n\ndef sub(a, b):")["input_ids"]
    plain = rt.generate(ids, max_new_tokens=24, speculative=False)
    spec = rt.generate(ids, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_acceptance_length > 1.2  # the packed bfloat16 drafter drafts sensibly
