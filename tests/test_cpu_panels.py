"""Float32 weights packed into 16-column panels (``kernels.cpu_linear.pack_f32``, ``weight_layout="panels"``,
the float32 CPU default): the outer-product kernel is close to the float64 reference, every row is
bit-identical whatever shares the call and on any thread count, and the layout changes no value a
user sees beyond a matmul's last bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.errors import UserError
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.target import resolve_layout
from tritonspec.runtime.tiny import tiny_config

WHY = cl.available(torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"CPU linear kernel unavailable for float32: {WHY}")
packs_by_default = pytest.mark.skipif(
    WHY is not None or not cl.panels_default(),
    reason="runtimes pack float32 drafters into panels on AVX2 and AVX-512 CPUs only (cpu_linear.panels_default)",
)


def _ref(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("n", [16, 48, 112])
@pytest.mark.parametrize("k", [1, 7, 99, 577])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(n, k, m, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = cl.cpu_linear(x, cl.pack_f32(w), b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # one rounding per fused multiply-add: the error grows with k like float32 summation does
    tol = 1e-6 * (k + 1) * float(_ref(x.abs(), w.abs()).max() + 1)
    assert float((y.double() - _ref(x, w, b)).abs().max()) <= tol


@settings(max_examples=30, deadline=None)
@given(
    panels=st.integers(1, 9),
    k=st.integers(1, 300),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_rows_are_invariant(panels, k, rows, seed, threads):
    """A row's bits do not depend on how many rows share the call, which rows they are (each row
    count picks another register tile), or the thread count."""
    g = torch.Generator().manual_seed(seed)
    w, x = cl.pack_f32(torch.randn(16 * panels, k, generator=g)), torch.randn(rows, k, generator=g)
    b = torch.randn(16 * panels, generator=g)
    full = cl.cpu_linear(x, w, b, threads=1)
    for m in sorted({1, 2, 3, 4, 5, 6, 7, 9, rows}):
        idx = torch.randperm(rows, generator=g)[: min(m, rows)]
        assert torch.equal(cl.cpu_linear(x[idx], w, b, threads=threads), full[idx]), m
    other = torch.randn(rows, k, generator=g) * 1e3  # other contents in the neighbouring rows
    other[0] = x[0]
    assert torch.equal(cl.cpu_linear(other, w, b, threads=threads)[0], full[0])


@pytest.mark.parametrize("m", [6, 7, 13, 64])
@pytest.mark.parametrize("n", [16, 48, 112, 576])
def test_wide_tiles_give_the_eight_lane_tiles_bits(m, n):
    """From 6 rows AVX-512 CPUs run 16-lane tiles (6 rows x 1, 2 or 4 panels); each lane is the same
    chain as the 8-lane tiles', so the bits are equal, eager and through the native operator, with a
    bias and a strided ``x``, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(m * 7 + n)
    w, b = cl.pack_f32(torch.randn(n, 99, generator=g)), torch.randn(n, generator=g)
    x = torch.randn(m, 130, generator=g)[:, 3:102]  # rows at stride 130
    old = cl.set_wide_panel_rows(0)
    assert old == (6 if cl.isa() == "avx512" else 0)  # the default: the wide tiles are on where they build
    try:
        assert cl.set_wide_panel_rows(0) == 0  # the setting took (CPUs without AVX-512 return 0 anyway)
        narrow = [cl.cpu_linear(x, w, b, threads=t) for t in (1, 2)] + [cl.linear(x, w, b)]
        cl.set_wide_panel_rows(6)
        wide = [cl.cpu_linear(x, w, b, threads=t) for t in (1, 2)] + [cl.linear(x, w, b)]
    finally:
        cl.set_wide_panel_rows(old)
    for a, c in zip(narrow, wide):
        assert torch.equal(a, c)
    assert torch.equal(narrow[0], narrow[2])
    with pytest.raises(ValueError, match="must be >= 0"):
        cl.set_wide_panel_rows(-1)


@pytest.mark.parametrize("m", [7, 8, 14, 15, 29, 43, 112, 113])
@pytest.mark.parametrize("n,k", [(16, 99), (80, 1), (80, 31), (80, 32), (80, 33), (48, 64), (576, 577)])
def test_tall_tiles_give_the_six_row_tiles_bits(m, n, k):
    """From 7 to 112 rows AVX-512 CPUs run tall tiles (up to 14 rows x 2 panels; more rows in several such tiles
    taking turns over blocks of 32 k-steps, their accumulators parked between blocks); each lane is the same
    chain as the 6-row tiles', so the bits are equal (and the tall path is seen to run): one tile and several, k
    below, at (32, 64) and past a block's end, an odd panel left over (80 columns), a bias, a strided ``x``, 1
    and 2 threads, the native operator; 113 rows runs the 6-row tiles either way."""
    g = torch.Generator().manual_seed(m * 31 + n + k)
    w, b = cl.pack_f32(torch.randn(n, k, generator=g)), torch.randn(n, generator=g)
    x = torch.randn(m, k + 40, generator=g)[:, 3 : 3 + k]  # rows at stride k + 40
    old = cl.set_tall_panel_rows(0)
    assert old == (112 if cl.isa() == "avx512" else 0)  # the default: the tall tiles are on where they build
    try:
        assert cl.set_tall_panel_rows(0) == 0
        before = cl.tall_panel_calls()
        six = [cl.cpu_linear(x, w, b, threads=t) for t in (1, 2)] + [cl.linear(x, w, b)]
        assert cl.tall_panel_calls() == before  # off: the 6-row tiles ran
        assert cl.set_tall_panel_rows(500) == 0  # capped at 112
        assert cl.set_tall_panel_rows(112) == (112 if cl.isa() == "avx512" else 0)
        tall = [cl.cpu_linear(x, w, b, threads=t) for t in (1, 2)] + [cl.linear(x, w, b)]
        ran = cl.tall_panel_calls() - before
    finally:
        cl.set_tall_panel_rows(old)
    assert ran == (3 if cl.isa() == "avx512" and m <= 112 else 0)  # the tall path really ran (or could not)
    for a, c in zip(six, tall):
        assert torch.equal(a, c)
    assert torch.equal(six[0], six[2])
    tol = 1e-6 * (k + 1) * float(_ref(x.abs(), cl.unpack(w).abs()).max() + 1)
    assert float((tall[1].double() - _ref(x, cl.unpack(w), b)).abs().max()) <= tol
    with pytest.raises(ValueError, match="must be >= 0"):
        cl.set_tall_panel_rows(-1)


def test_invariance_check_sees_a_changed_row():
    """The inverse: the comparison above is not vacuous. MKL's one-row and eight-row calls round some
    row differently on these shapes, and the panel kernel's bits differ from the ``[N, K]`` kernel's
    (another summation order), so a path that switched between them would be caught."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(576, 1536, generator=g), torch.randn(8, 1536, generator=g)
    panels, rows = cl.cpu_linear(x, cl.pack_f32(w)), cl.cpu_linear(x, w)
    assert not torch.equal(panels, rows)
    assert float((panels - rows).abs().max()) < 1e-3


def test_pack_roundtrip_and_slices():
    w = torch.randn(48, 33)
    wp = cl.pack_f32(w)
    assert wp.shape == (3, 33, 16) and cl.is_packed(wp)
    assert (cl.out_features(wp), cl.in_features(wp)) == (48, 33)
    assert torch.equal(cl.unpack(wp), w)
    assert torch.equal(cl.unpack(wp[1:2]), w[16:32])  # one panel: its 16 rows
    assert torch.equal(cl.unpack(wp[-1:, :5].contiguous()), w[32:, :5])
    assert cl.unpack(w) is w


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="N % 16"):
        cl.pack_f32(torch.randn(17, 8))
    with pytest.raises(ValueError, match="into panels"):
        cl.pack_f32(torch.randn(16, 8).bfloat16())
    wp = cl.pack_f32(torch.randn(16, 8))
    with pytest.raises(ValueError, match="K=9"):
        cl.cpu_linear(torch.randn(2, 9), wp)
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(torch.randn(2, 8).bfloat16(), wp)
    with pytest.raises(ValueError, match="K=8"):
        cl.cpu_linear(torch.randn(2, 8), wp.view(1, 16, 8).contiguous())  # not a [N/16, K, 16] panel
    with pytest.raises(ValueError, match="no autograd"):
        cl.linear(torch.randn(2, 8, requires_grad=True), wp)
    with pytest.raises(ValueError, match="K=9"):  # the dispatcher checks a packed weight too
        cl.linear(torch.randn(2, 9), wp)
    with pytest.raises(ValueError, match="bfloat16 x"):
        cl.linear(torch.randn(2, 8).bfloat16(), wp)


def test_native_operator_and_compiled_call_run_the_same_kernel():
    w, x = cl.pack_f32(torch.randn(64, 99)), torch.randn(5, 99)
    ref = cl._launch_ctypes(x, w, None, None)
    assert torch.equal(cl.cpu_linear(x, w), ref)
    if cl.native_op() is None:
        assert torch.equal(torch.ops.tritonspec_cpu.linear(x, w, None, -1), ref)
    fn = torch.compile(lambda a: cl.linear(a, w), fullgraph=True)
    assert torch.equal(fn(x), ref)


@pytest.mark.parametrize(
    "isa, intel, f32, bf16",
    [
        ("avx2", False, True, True),
        ("avx2", True, True, True),
        ("avx512", False, True, False),
        ("avx512", True, True, False),
        (None, False, False, False),
    ],
)
def test_panels_default_follows_where_it_was_measured(monkeypatch, isa, intel, f32, bf16):
    """AVX2: both dtypes; AVX-512 (AMD Zen 4, Intel Xeon): float32 only; CPUs without the kernels:
    never. The runtime's layout and the drafter's packing follow the same answer per dtype."""
    monkeypatch.setattr(cl, "isa", lambda: isa)
    monkeypatch.setattr(cl, "INTEL", intel)
    assert (cl.panels_default(), cl.panels_default(torch.float32), cl.panels_default(torch.bfloat16)) == (
        f32,
        f32,
        bf16,
    )
    cpu = torch.device("cpu")
    for dtype, want in ((torch.float32, f32), (torch.bfloat16, bf16)):
        d = ts.Eagle3Drafter.for_target(tiny_config(), draft_vocab_size=48).to(dtype)
        assert d.packs_on(TorchOps()) == want
        if not (cl.amx_available() is None and dtype == torch.bfloat16):  # AMX tiles come first for bfloat16
            assert (resolve_layout("auto", cpu, dtype) == "panels") == want


@pytest.mark.skipif(cl.available(torch.float32) is not None, reason="the CPU kernels do not run float32 here")
@pytest.mark.parametrize("intel", [False, True])
def test_panels_pay_packs_small_weights_on_every_cpu(monkeypatch, intel):
    """Small, cache-resident weights (the demo's 128-wide projections, below ``MIN_WEIGHT`` / ``MIN_K``)
    pack too, on Intel as elsewhere: the panel kernel's 4-16-row calls (a verify) beat MKL's there
    (``panels_pay``). ``SIZE_FLOORS`` still sends a small *unpacked* weight to ``F.linear``. Inverse: a
    weight ``pack_panels`` cannot take (N % 16 != 0) stays ``[N, K]``; and the demo target loaded with
    the default layout on a CPU whose default is panels has every projection packed."""
    monkeypatch.setattr(cl, "SIZE_FLOORS", intel)
    small = torch.randn(128, 128)
    assert small.numel() < cl.MIN_WEIGHT and cl.panels_pay(small)
    assert not cl.panels_pay(torch.randn(120, 128))  # N % 16 != 0
    if intel:  # an unpacked small weight under the floors: MKL, exactly
        x = torch.randn(5, 128)
        assert torch.equal(cl.linear(x, small), F.linear(x, small))
    if ts.demo.available() and cl.panels_default():
        t = ts.TargetModel.from_pretrained(ts.demo.demo_pair()[0])
        assert t.weight_layout == "panels"
        assert all(getattr(layer, n).dim() == 3 for layer in t.layers for n in ("wqkv", "wo", "gate_up", "down"))


def test_layout_is_the_float32_default_and_checked():
    cpu = torch.device("cpu")
    assert resolve_layout("auto", cpu, torch.float32) == ("panels" if cl.panels_default() else "nk")
    assert resolve_layout("auto", cpu, torch.float32, "torch") == "kn"  # no kernel: F.linear's fast layout
    with pytest.raises(UserError, match="weight_layout='panels'.*float32 and bfloat16"):
        resolve_layout("panels", cpu, torch.float16)
    with pytest.raises(UserError, match="kernels are off"):
        resolve_layout("panels", cpu, torch.float32, "torch")


@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
def test_panels_target_matches_nk_and_saves_the_same_weights(tmp_path):
    """The demo target in both layouts: every projection packed (the tied head as its own packed copy,
    the embedding kept for lookups), the same weights written back, logits equal to a matmul's last
    bits, and the same greedy tokens."""
    target, drafter = ts.demo.demo_pair()
    nk = ts.TargetModel.from_pretrained(target, weight_layout="nk")
    pn = ts.TargetModel.from_pretrained(target, weight_layout="panels")
    assert pn.weight_layout == "panels" and pn.layers[0].wqkv.dim() == 3 and pn.lm_head.dim() == 3
    assert pn.embed.dim() == 2 and torch.equal(cl.unpack(pn.lm_head), nk.lm_head)
    assert torch.equal(pn.layers[-1].wq, nk.layers[-1].wq) and torch.equal(pn.layers[0].up, nk.layers[0].up)
    a, b = nk.state_dict(), pn.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from tritonspec.runtime import profiles

    assert profiles.target_fingerprint(nk) == profiles.target_fingerprint(pn)  # tuned profiles still apply
    tok = ts.runtime.engine.load_tokenizer(target)
    ids = tok("def add(a, b):")["input_ids"]
    outs = [
        ts.SpeculativeRuntime(t, ts.Eagle3Drafter.from_pretrained(drafter), tok).generate(
            ids, max_new_tokens=12, speculative=False
        )
        for t in (nk, pn)
    ]
    assert outs[0].token_ids == outs[1].token_ids


@packs_by_default
@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
def test_drafter_runs_packed_only_where_its_runtime_runs_the_kernel(monkeypatch):
    """A runtime whose ops run the float32 kernel packs its drafter (fused q/k/v and gate/up) and
    every drafter projection reaches the kernel as a packed weight; a runtime with
    ``cpu_linear="torch"`` sharing the same module keeps ``F.linear`` on its weights; the two give
    the same greedy tokens (verification is exact), and a weight changed in place is repacked (the
    inverse: a stale copy would keep the old logits)."""
    target, drafter = ts.demo.demo_pair()
    tok = ts.runtime.engine.load_tokenizer(target)
    d = ts.Eagle3Drafter.from_pretrained(drafter)
    kern = ts.SpeculativeRuntime(ts.TargetModel.from_pretrained(target), d, tok)
    assert kern.drafter is d and d._packed is not None  # packed at attach
    kn = ts.TargetModel.from_pretrained(target, weight_layout="kn")
    plain_ops = ts.SpeculativeRuntime(kn, d, tok, cpu_linear="torch")
    assert torch.float32 in kern.ops.packs_cpu_weights and torch.float32 not in plain_ops.ops.packs_cpu_weights
    seen = []
    real = cl.linear

    def spy(x, w, b=None, prompt=False):
        seen.append(w.dim())
        return real(x, w, b, prompt)

    ids = tok("def add(a, b):")["input_ids"]
    monkeypatch.setattr(cl, "linear", spy)
    hn = torch.randn(1, 1, d.config.hidden_size)
    with torch.no_grad():
        packed_logits = d.logits(hn, kern.ops)
        assert seen == [3]  # the head, packed
        assert torch.allclose(packed_logits, d.logits(hn, plain_ops.ops), atol=1e-4)
        outs = [rt.generate(ids, max_new_tokens=10).token_ids for rt in (kern, plain_ops)]
    assert outs[0] == outs[1]
    with torch.no_grad():
        d.lm_head.weight.mul_(2)  # in place: the packed copy is stale
        assert torch.allclose(d.logits(hn, kern.ops), 2 * packed_logits, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():
        seen.clear()
        d.logits(hn, kern.ops)  # autograd on: the module's own [N, K] weight
        assert seen == [] or seen == [2]


@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
def test_runtime_refuses_torch_linear_on_packed_weights():
    target, _ = ts.demo.demo_pair()
    tm = ts.TargetModel.from_pretrained(target, weight_layout="panels")
    with pytest.raises(UserError, match="weight_layout='kn' or 'nk'"):
        ts.SpeculativeRuntime(tm, None, ts.runtime.engine.load_tokenizer(target), cpu_linear="torch")
    rt = ts.SpeculativeRuntime.from_pretrained(target, cpu_linear="torch")  # picks a layout F.linear runs
    assert rt.target.weight_layout == "kn" and not rt.cpu_kernels


@packs_by_default
@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
@pytest.mark.parametrize("deterministic", [False, True])
def test_drafter_pack_survives_inference_mode_and_in_place_updates(deterministic):
    """A drafter loaded under inference_mode packs (no version counter to read), and a deterministic
    runtime keeps generating after the drafter changed in place (the repack, made inside the
    engine's inference_mode, must not be an inference tensor); the copy follows the change."""
    target, drafter = ts.demo.demo_pair()
    tok = ts.runtime.engine.load_tokenizer(target)
    with torch.inference_mode():
        frozen = ts.Eagle3Drafter.from_pretrained(drafter)
        rt = ts.SpeculativeRuntime.from_pretrained(target, frozen, deterministic=deterministic)
        assert len(rt.generate(tok("x = 1")["input_ids"], max_new_tokens=4).token_ids[0]) == 4
    d = ts.Eagle3Drafter.from_pretrained(drafter)
    rt = ts.SpeculativeRuntime.from_pretrained(target, d, deterministic=deterministic)
    ids = tok("def add(a, b):")["input_ids"]
    first = rt.generate(ids, max_new_tokens=8)
    head = d.cpu_pack_tensors()[-1]
    with torch.no_grad():
        d.lm_head.weight.mul_(-1)  # in place: drafts change, output must not
    again = rt.generate(ids, max_new_tokens=8)
    assert again.token_ids == first.token_ids
    assert d.cpu_pack_tensors()[-1] is head and not head.is_inference()  # repacked in place
    assert torch.equal(cl.unpack(head), d.lm_head.weight) if head.dim() == 3 else torch.equal(head, d.lm_head.weight)


@packs_by_default
@pytest.mark.skipif(not ts.demo.available(), reason="the demo pair is not built")
def test_captured_rounds_read_the_repacked_drafter():
    """Emulated captured rounds (the make_fx path compile=True shares) see an in-place change of the
    drafter's weights: zeroing its head collapses acceptance as it does eagerly (the inverse of a
    stale graph constant, which would keep the old acceptance)."""
    target, drafter = ts.demo.demo_pair()
    tok = ts.runtime.engine.load_tokenizer(target)
    ids = tok("def add(a, b):\n    return a + b\n\ndef sub(a, b):")["input_ids"]
    from tritonspec.runtime.graphs import GraphRunner, default_sizes

    taus = {}
    for mode in ("emulate", "eager"):
        d = ts.Eagle3Drafter.from_pretrained(drafter)
        rt = ts.SpeculativeRuntime.from_pretrained(target, d, spec=ts.SpecConfig.chain(4), max_batch_size=1)
        if mode == "emulate":
            rt._graphs = GraphRunner(default_sizes(1), "emulate")
        before = rt.generate(ids, max_new_tokens=24).stats.mean_acceptance_length
        with torch.no_grad():
            d.lm_head.weight.zero_()
        after = rt.generate(ids, max_new_tokens=24).stats.mean_acceptance_length
        taus[mode] = (before, after)
    assert rt._graphs is None and taus["emulate"][0] > 1.5
    assert taus["emulate"][1] == pytest.approx(taus["eager"][1]) and taus["emulate"][1] < taus["emulate"][0]
