"""Weight-only bfloat16 drafter projections (``kernels.cpu_linear.weight_only_bf16``,
``SpeculativeRuntime(drafter_weight_dtype="bfloat16")``): float32 activations on bfloat16 panels give the
float32 panel kernel's bits on the widened weights (odd shapes, bias, strided rows, threads, ctypes and the
native operator); the native drafter step runs them with the Python step's bits; a runtime keeps its
greedy output, packs the decode weights as bfloat16 and the prompt weights as float32, leaves the caller's
drafter alone, and refuses the option where it cannot apply, saying why."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_drafter
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.ops import TorchOps

from _util import runtime

WHY = cl.available(torch.float32) or cl.available(torch.bfloat16)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the CPU kernels do not run float32 and bfloat16 here: {WHY}")


def _case(M: int, N: int, K: int, seed: int, bias: bool, stride: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K + stride, generator=g)[:, :K]  # stride > 0: rows at a stride of K + stride
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 13, 64])
@pytest.mark.parametrize("N,K", [(16, 1), (48, 7), (32, 99), (96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_is_the_float32_kernel_on_the_widened_weights(M, N, K, bias):
    x, w, b = _case(M, N, K, M * 1000 + N + K, bias, stride=3 if M % 2 else 0)
    want = cl.cpu_linear(x, cl.pack_f32(w.bfloat16().float()), b)
    for threads in (1, 2):
        got = cl.cpu_linear(x, cl.weight_only_bf16(w), b, threads=threads)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        assert torch.equal(got, want), f"threads={threads}: max diff {(got - want).abs().max()}"
    ctypes_y = cl._launch_ctypes(x, cl.weight_only_bf16(w), b, None)
    assert torch.equal(ctypes_y, want), "the ctypes entry point differs from the native operator"


@settings(max_examples=40, deadline=None)
@given(
    M=st.integers(1, 40),
    panels=st.integers(1, 9),
    K=st.integers(1, 200),
    seed=st.integers(0, 2**16),
    rows=st.data(),
)
def test_a_row_does_not_depend_on_the_others(M, panels, K, seed, rows):
    """Row-invariant: each row of a call equals the same row computed alone, whatever the row count and
    the other rows' values (what a decode round's drafter rows need)."""
    x, w, _ = _case(M, 16 * panels, K, seed, False)
    wp = cl.weight_only_bf16(w)
    y = cl.cpu_linear(x, wp)
    i = rows.draw(st.integers(0, M - 1))
    assert torch.equal(y[i : i + 1], cl.cpu_linear(x[i : i + 1].clone(), wp))


def test_the_rounding_is_live():
    """Inverse: the result differs from the unrounded float32 weights' (so the equality above is not the
    float32 kernel run twice), and stays within bfloat16's relative error of it."""
    x, w, b = _case(5, 48, 99, 1, True)
    exact = cl.cpu_linear(x, cl.pack_f32(w), b)
    got = cl.cpu_linear(x, cl.weight_only_bf16(w), b)
    assert not torch.equal(got, exact)
    assert torch.allclose(got, exact, rtol=0.0, atol=0.05 * exact.abs().max().item())


def test_bad_inputs_are_refused():
    x, w, b = _case(2, 32, 16, 0, True)
    with pytest.raises(ValueError, match="float32"):
        cl.weight_only_bf16(w.bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(x, w.bfloat16(), b)  # an [N, K] bfloat16 weight: only panels mix dtypes
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(x, cl.weight_only_bf16(w), b.bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(x.bfloat16(), cl.pack_f32(w), None)


def _native_ready() -> bool:
    return cl.native_op() is None and torch.float32 in TorchOps().packs_cpu_weights


@pytest.mark.skipif(not _native_ready(), reason="no native operator, or this CPU does not pack float32 drafters")
@pytest.mark.parametrize("spec", ["chain", "tree+lookup"])
def test_runtime_output_packing_and_the_callers_module(spec):
    """Demo pair: the same greedy tokens as plain decoding and as float32 drafter weights; the decode
    weights are bfloat16 panels, the prompt's float32 ones; the native step ran on them; the caller's
    drafter module is not repacked; the proposals moved (the rounding reaches the drafter)."""
    cfg = {
        "chain": ts.SpecConfig.chain(4),
        "tree+lookup": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6, prompt_lookup_num_tokens=4),
    }[spec]
    target, drafter = ts.demo_pair("eagle3.1")
    d = ts.Eagle3Drafter.from_pretrained(drafter)
    plain = runtime(target, d, spec=cfg, max_batch_size=2, max_seq_len=256)
    rt = runtime(target, d, spec=cfg, max_batch_size=2, max_seq_len=256, drafter_weight_dtype="bfloat16")
    assert rt.drafter is not d and rt.drafter_weight_dtype == torch.bfloat16 and d.cpu_weight_dtype is None
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n"]
    ran = []  # what each native drafter operator returned (None / False: it declined)
    names = ("drafter_step", "draft_chain", "draft_tree", "catch_up")
    real = {n: getattr(cpu_drafter, n) for n in names}
    for n in names:
        setattr(cpu_drafter, n, lambda *a, _f=real[n], _n=n: ran.append((_n, _f(*a))) or ran[-1][1])
    try:
        out = rt.generate(prompts, max_new_tokens=24)
    finally:
        for n in names:
            setattr(cpu_drafter, n, real[n])
    assert ran and all(r is not None and r is not False for _, r in ran), "a native step declined the bfloat16 panels"
    assert {n for n, _ in ran} >= {"catch_up", "draft_chain" if spec == "chain" else "draft_tree"}
    assert out.token_ids == plain.generate(prompts, max_new_tokens=24, speculative=False).token_ids
    assert out.token_ids == plain.generate(prompts, max_new_tokens=24).token_ids
    decode, prompt = rt.drafter._packed[1], rt.drafter._prompt_pack
    panels = {n: w.dtype for n, w in decode.items() if w.dim() == 3}  # (Intel keeps small weights [N, K])
    assert "head" in panels and set(panels.values()) == {torch.bfloat16}
    assert all(w.dtype == torch.float32 for w in prompt.values()) and "head" not in prompt  # logits: last row
    assert all(w.dtype == torch.float32 for w in (plain.drafter._packed[1] or {}).values())
    hn = torch.randn(3, d.config.hidden_size)
    with torch.inference_mode():
        assert not torch.equal(rt.drafter.logits(hn, rt.ops), plain.drafter.logits(hn, plain.ops))


def test_the_option_is_refused_where_it_cannot_apply():
    target, drafter = ts.demo_pair("eagle3.1")
    with pytest.raises(ts.UserError, match="drafter_weight_dtype='float16'"):
        runtime(target, drafter, drafter_weight_dtype="float16")
    with pytest.raises(ts.UserError, match="there is no drafter"):
        runtime(target, None, drafter_weight_dtype="bfloat16")
    with pytest.raises(ts.UserError, match="does not pack float32 drafter weights"):
        runtime(target, drafter, drafter_weight_dtype="bfloat16", cpu_linear="torch")
    with pytest.raises(ts.UserError, match="not float32"):
        runtime(target, drafter, drafter_weight_dtype="bfloat16", dtype=torch.bfloat16)


@pytest.mark.skipif(not _native_ready(), reason="no native operator, or this CPU does not pack float32 drafters")
def test_cli_flag():
    cmd = [sys.executable, "-m", "tritonspec", "generate", "def f(x):", "--max-new-tokens", "8"]
    out = subprocess.run([*cmd, "--drafter-weight-dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "drafter_weights=bfloat16" in out.stdout + out.stderr
    bad = subprocess.run([*cmd, "--drafter-weight-dtype", "bfloat16", "--cpu-linear", "torch"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "drafter_weight_dtype='bfloat16'" in bad.stderr


@pytest.mark.skipif(not _native_ready(), reason="no native operator, or this CPU does not pack float32 drafters")
def test_auto_applies_to_a_drafter_loaded_from_a_directory_only():
    """The default ``drafter_weight_dtype="auto"``: bfloat16 for a drafter the runtime loads from a directory; a
    module the caller passes keeps its dtype and is shared, not copied (inverse: explicit "bfloat16" copies it)."""
    target, drafter = ts.demo_pair("eagle3.1")
    assert runtime(target, drafter).drafter_weight_dtype == torch.bfloat16
    d = ts.Eagle3Drafter.from_pretrained(drafter)
    shared = runtime(target, d)
    assert shared.drafter is d and shared.drafter_weight_dtype is None and d.cpu_weight_dtype is None
    assert runtime(target, d, drafter_weight_dtype="bfloat16").drafter is not d
