"""A prompt's float32 projections on AMX (``kernels/cpu/linear.c`` ``tritonspec_linear_f32_amx3``, issue 17):
x and w split exactly into three bfloat16 parts, six part products on the tile unit, float32 accumulation. As close
to the float64 reference as the panel kernel (and far closer than bfloat16 alone: the inverse check) over odd
shapes, bias, panel-packed and ``[N, K]`` weights; each row's result independent of the call's other rows and of
the thread count; only a prompt's calls of at least ``PROMPT_AMX_ROWS`` rows take it (decode rounds never do);
packed weights are cached and repacked after an in-place write; greedy output end to end unchanged. The packing
itself is checked everywhere; the kernel's tests are skipped where AMX does not run (the reason says why)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl

WHY = cl.available(torch.float32) or cl.amx_available()
needs_amx = pytest.mark.skipif(WHY is not None, reason=f"the AMX prompt projections do not run here: {WHY}")
ROWS = cl.PROMPT_AMX_ROWS


@pytest.fixture(autouse=True)
def amx_on():
    if WHY is not None:
        yield
        return
    old = cl.set_prompt_amx(True)
    yield
    cl.set_prompt_amx(old)


def _run(x, w, b=None, prompt=True):
    """(y, whether the AMX path ran)"""
    before = cl.prompt_amx_calls()
    y = cl.linear(x, w, b, prompt=prompt)
    return y, cl.prompt_amx_calls() > before


def _ref(x, w, b=None):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _err(y, ref):
    return (y.double() - ref).abs().max().item()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    kb=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e4, 1e30]),
)
def test_pack_amx3_parts_sum_exactly(n, kb, seed, scale):
    """w = w0 + w1 + w2 exactly, each part a bfloat16 value, in the documented tile layout (runs on any CPU).
    Values whose last part falls below 2^-126 (|w| < ~2^-110) lose it: bfloat16 subnormals keep 7 bits, and
    AMX reads them as zero anyway (kernels/cpu/linear.c)."""
    g = torch.Generator().manual_seed(seed)
    N, K = 16 * n, 32 * kb
    w = torch.randn(N, K, generator=g) * scale
    w[0, :3] = torch.tensor([0.0, -0.0, 1.0 + 2**-23])
    parts = cl.pack_amx3_reference(w).view(torch.bfloat16).float()  # [NB, KB, 3, 16, 32]
    layout = parts.view(N // 16, K // 32, 3, 16, 16, 2).permute(2, 0, 4, 1, 3, 5).reshape(3, N, K)
    assert torch.equal(layout[0] + layout[1] + layout[2], w)
    assert torch.equal(layout[0], (w.view(torch.int32) & -65536).view(torch.float32))  # w0: w truncated
    assert torch.equal(cl.pack_amx3(cl.pack_panels(w)), cl.pack_amx3(w))  # panels unpack first
    assert torch.equal(cl.pack_amx3_reference(w), cl.pack_amx3(w))  # the C packer where it builds


def test_pack_amx3_rejects_what_the_kernel_cannot_take():
    for w in (torch.randn(24, 64), torch.randn(32, 48), torch.randn(32, 64).bfloat16()):
        with pytest.raises(ValueError, match="pack_amx3 takes a float32"):
            cl.pack_amx3(w)


@needs_amx
@pytest.mark.parametrize("M", [ROWS, 99, 257])
@pytest.mark.parametrize(("K", "N"), [(32, 16), (128, 48), (384, 128), (576, 192)])
@pytest.mark.parametrize("layout", ["nk", "panels"])
def test_matches_reference_as_closely_as_the_panel_kernel(M, K, N, layout):
    g = torch.Generator().manual_seed(M * 13 + K + N)
    x, w, b = torch.randn(1, M, K, generator=g), 0.05 * torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    wl = w if layout == "nk" else cl.pack_panels(w)
    for bias in (None, b):
        y, ran = _run(x, wl, bias)
        assert ran
        assert y.shape == (1, M, N) and y.dtype == torch.float32
        panel, _ = _run(x, cl.pack_panels(w), bias, prompt=False)
        ref = _ref(x, w, bias)
        assert _err(y, ref) <= 2 * _err(panel, ref) + 1e-7


@needs_amx
def test_three_parts_are_needed():
    """The inverse: bfloat16 operands alone land over a thousand times further from the reference than the split
    (~2e-1 against ~3e-5 on outputs of ~100): the agreement above is the split's doing, not a tolerance loose
    enough for bfloat16."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(128, 576, generator=g), torch.randn(192, 576, generator=g)
    ref = _ref(x, w)
    y, ran = _run(x, w)
    assert ran
    assert _err(_ref(x.bfloat16().float(), w.bfloat16().float()), ref) > 1000 * _err(y, ref)


@needs_amx
@settings(max_examples=20, deadline=None)
@given(M=st.integers(ROWS, 300), kb=st.integers(1, 5), n=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_a_row_does_not_depend_on_the_call(M, kb, n, seed):
    """Each output is its x row against its weight row, over k blocks in one order: the same bits whatever
    rows share the call, where a row sits in it, and on one or two threads (strided x rows too)."""
    g = torch.Generator().manual_seed(seed)
    K, N = 32 * kb, 16 * n
    wide = torch.randn(M, K + 7, generator=g)
    x, w = wide[:, :K], torch.randn(N, K, generator=g)  # x rows at a stride of K + 7
    y, ran = _run(x, w)
    assert ran
    perm = torch.randperm(M, generator=g)
    yp, _ = _run(x[perm].contiguous(), w)
    assert torch.equal(yp, y[perm])
    other = torch.cat([x[: ROWS // 2], torch.randn(ROWS, K, generator=g) * 1e3])
    yo, _ = _run(other, w)
    assert torch.equal(yo[: ROWS // 2], y[: ROWS // 2])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(_run(x, w)[0], y)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_only_a_prompts_float32_calls_of_enough_rows_take_it():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(ROWS, 128, generator=g), torch.randn(64, 128, generator=g)
    assert _run(x, w)[1]
    assert not _run(x[: ROWS - 1], w)[1]  # too few rows
    assert not _run(x, w, prompt=False)[1]  # a decode round's call
    assert not _run(x.bfloat16(), w.bfloat16())[1]  # bfloat16 has its own kernels
    y, ran = _run(torch.randn(ROWS, 100, generator=g), torch.randn(64, 100, generator=g))
    assert not ran and y.shape == (ROWS, 64)  # K % 32 != 0 runs the other kernels
    wg = w.clone().requires_grad_()
    y, ran = _run(x, wg)
    assert not ran and y.requires_grad  # autograd keeps F.linear
    cl.set_prompt_amx(False)
    assert not _run(x, w)[1]
    assert cl.set_prompt_amx(True) is False and cl.set_prompt_amx(True) is True


@needs_amx
def test_packed_weights_are_cached_and_repacked_after_a_write():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(ROWS, 64, generator=g), torch.randn(32, 64, generator=g)
    y1, _ = _run(x, w)
    parts = cl._amx3_cache[cl._amx3_key(w)][2]
    _run(x, w)
    assert cl._amx3_cache[cl._amx3_key(w)][2] is parts  # not packed again
    panels = cl.pack_panels(torch.cat([w, w]))
    _run(x, panels[:2])  # a view made afresh per call (the first two panels: w's rows) ...
    view_parts = cl._amx3_cache[cl._amx3_key(panels[:2])][2]
    assert torch.equal(_run(x, panels[:2])[0], y1)
    assert cl._amx3_cache[cl._amx3_key(panels[:2])][2] is view_parts  # ... hits the same entry
    w.mul_(2.0)  # in place: the version moves
    y2, ran = _run(x, w)
    assert ran and cl._amx3_cache[cl._amx3_key(w)][2] is not parts
    assert torch.equal(y2, 2 * y1)  # x 2 is exact in every part
    n = len(cl._amx3_cache)
    del w, panels, parts, view_parts
    _run(x, torch.randn(16, 64, generator=g))  # a miss sweeps the freed storages' entries
    assert len(cl._amx3_cache) == n - 1
    cl.set_prompt_amx(False)
    assert not cl._amx3_cache


@needs_amx
def test_inference_tensor_weights():
    """Weights made in inference mode keep no version counter: they run, stay cached, and a write in place (in
    inference mode) is still seen."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(ROWS, 64, generator=g)
    with torch.inference_mode():
        w = torch.randn(32, 64, generator=g)
        y1, ran = _run(x, w)
        assert ran and torch.allclose(y1, x @ w.T, atol=1e-5)
        parts = cl._amx3_cache[cl._amx3_key(w)][2]
        _run(x, w)
        assert cl._amx3_cache[cl._amx3_key(w)][2] is parts
        w.mul_(2.0)
        y2, _ = _run(x, w)
    assert torch.equal(y2, 2 * y1)


@needs_amx
def test_runtime_prompts_only_and_greedy_output_unchanged():
    """End to end on the demo pair: a prompt's forward runs the AMX projections, decode rounds never do (the
    count after a 1-token and a 16-token generation is the same), and greedy tokens match the panel kernel's,
    plain and speculative."""
    t, d = ts.demo.demo_pair("eagle3.1")
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cpu", max_batch_size=2)
    prompts = [r["prompt"] for r in ts.demo.prompt_set("standard")[:4]]
    counts = []
    for n in (1, 16):
        before = cl.prompt_amx_calls()
        rt.generate(prompts[:1], max_new_tokens=n)
        counts.append(cl.prompt_amx_calls() - before)
    assert counts[0] > 0 and counts[0] == counts[1]
    amx = rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids
    assert rt.generate(prompts, max_new_tokens=12).token_ids == amx
    cl.set_prompt_amx(False)
    assert rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids == amx


@needs_amx
def test_deterministic_mode_never_takes_it():
    """The same prompt takes the path in the default mode (the inverse: the prompt is long enough to)."""
    t, d = ts.demo.demo_pair("eagle3.1")
    prompt = ts.demo.prompt_set("standard")[0]["prompt"]
    for deterministic in (True, False):
        rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cpu", deterministic=deterministic)
        before = cl.prompt_amx_calls()
        rt.generate(prompt, max_new_tokens=4)
        assert (cl.prompt_amx_calls() > before) is not deterministic
