"""Causal prefill attention on the CPU (``kernels/cpu_prefill.py``, issue 17): close to the float64
reference over odd prompt lengths, GQA groups, head dims and strided inputs; the masked half really is
masked (the inverse check); bad inputs are named; the torch backend takes it for float32 prompts on
AVX-512 CPUs and a prompt's greedy output is unchanged end to end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_prefill as cp
from tritonspec.kernels.prefill_attention import prefill_attention
from tritonspec.runtime.ops import TorchOps

WHY = cl.available(torch.float32)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"CPU kernels unavailable here: {WHY}")


@pytest.fixture(autouse=True)
def avx512_tile():
    """This file tests the AVX-512 (or AVX2) tile: on CPUs with AMX, prompts of ``AMX_MIN_TOKENS`` or more would
    run the AMX tile instead, which ``tests/test_cpu_prefill_amx.py`` tests."""
    old = cp.set_amx(False)
    yield
    cp.set_amx(old)


def _case(g, B, P, Hq, Hkv, D):
    return tuple(torch.randn(B, P, h, D, generator=g) for h in (Hq, Hkv, Hkv))


@pytest.mark.parametrize("P", [1, 7, 8, 9, 31, 33, 99, 257])
@pytest.mark.parametrize(("Hq", "Hkv", "D"), [(4, 2, 32), (9, 3, 64), (2, 2, 16), (8, 1, 48), (1, 1, 256)])
def test_matches_reference(P, Hq, Hkv, D):
    g = torch.Generator().manual_seed(P * 100 + D)
    q, k, v = _case(g, 2, P, Hq, Hkv, D)
    out = cp.cpu_prefill_attention(q, k, v, D**-0.5)
    ref = cp.cpu_prefill_attention_reference(q, k, v, D**-0.5)
    assert out.shape == (2, P, Hq, D) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    P=st.integers(1, 140),
    kv=st.integers(1, 3),
    group=st.integers(1, 4),
    chunks=st.integers(1, 5),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_strided_inputs_and_threads(B, P, kv, group, chunks, threads, seed):
    """q, k, v as views of one fused qkv projection (the target's layout): strided rows and heads,
    any thread count; SDPA's causal attention agrees to float32 rounding."""
    g = torch.Generator().manual_seed(seed)
    Hq, D = kv * group, 16 * chunks
    qkv = torch.randn(B, P, (Hq + 2 * kv) * D, generator=g)
    q, k, v = qkv.split([Hq * D, kv * D, kv * D], dim=-1)
    q, k, v = q.view(B, P, Hq, D), k.view(B, P, kv, D), v.view(B, P, kv, D)
    out = cp.cpu_prefill_attention(q, k, v, 0.3, threads=threads)
    assert torch.allclose(out, cp.cpu_prefill_attention_reference(q, k, v, 0.3), rtol=1e-5, atol=1e-5)
    assert torch.allclose(out, prefill_attention(q, k, v, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("order", ["rising", "falling"])
@pytest.mark.parametrize("P", [33, 130])
def test_running_max_rescales(order, P):
    """The online softmax's rescaling across key blocks: scores that rise key after key move every row's
    maximum in every block (exp(m_old - m_new) < 1 each time), falling ones keep the first key's (the
    factor is exactly 1); large spreads, so a wrong factor or a sum kept from the wrong block shows (scores
    up to ~130: float32 scores round at ~1e-5 there, SDPA's error too, hence the tolerance)."""
    g = torch.Generator().manual_seed(P)
    D, u = 32, torch.ones(32) / 32**0.5
    ramp = torch.arange(P, dtype=torch.float32) * 0.2
    k = (ramp if order == "rising" else -ramp)[:, None, None] * u + 0.01 * torch.randn(P, 2, D, generator=g)
    q = (5.0 * u).expand(P, 4, D).contiguous() + 0.1 * torch.randn(P, 4, D, generator=g)
    v = torch.randn(P, 2, D, generator=g)
    q, k, v = q[None], k[None], v[None]
    out = cp.cpu_prefill_attention(q, k, v, 1.0)
    assert torch.allclose(out, cp.cpu_prefill_attention_reference(q, k, v, 1.0), rtol=1e-4, atol=1e-4)


def test_the_future_is_masked():
    """The inverse: the comparison is not vacuous. Changing a later key or value changes no earlier
    row and does change its own row; full (non-causal) attention differs from the output."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _case(g, 1, 50, 4, 2, 32)
    out = cp.cpu_prefill_attention(q, k, v, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[:, 30:] += 3.0
    v2[:, 30:] -= 2.0
    out2 = cp.cpu_prefill_attention(q, k2, v2, 0.2)
    assert torch.equal(out[:, :30], out2[:, :30])
    assert not torch.allclose(out[:, 30:], out2[:, 30:])
    full = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.2, enable_gqa=True
    ).transpose(1, 2)
    assert not torch.allclose(out, full, atol=1e-3)


def test_bad_inputs_are_named():
    q = torch.randn(1, 5, 4, 32)
    with pytest.raises(ValueError, match="float32"):
        cp.cpu_prefill_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), 0.1)
    with pytest.raises(ValueError, match="multiple of 16"):
        cp.cpu_prefill_attention(q[..., :20], q[..., :20], q[..., :20], 0.1)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        cp.cpu_prefill_attention(q, q[:, :, :3], q[:, :, :3], 0.1)
    assert not cp.supported(q.transpose(2, 3), q.transpose(2, 3), q.transpose(2, 3))


def test_torch_backend_takes_it_on_avx512_float32(monkeypatch):
    """TorchOps.prefill_attention runs the kernel where ``runs`` says so (AVX-512, float32, eager),
    else SDPA; both agree to float32 rounding."""
    calls = []
    real = cp.cpu_prefill_attention_unchecked
    monkeypatch.setattr(cp, "cpu_prefill_attention_unchecked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    q, k, v = _case(g, 1, 40, 4, 2, 32)
    ops = TorchOps()
    out = ops.prefill_attention(q, k, v, 0.25)
    assert len(calls) == (1 if cl.isa() == "avx512" else 0)
    assert torch.allclose(out, prefill_attention(q, k, v, 0.25), rtol=1e-4, atol=1e-5)
    ops.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25)  # bfloat16: SDPA
    assert TorchOps(cpu_linear="torch").prefill_attention(q, k, v, 0.25).shape == q.shape
    assert len(calls) == (1 if cl.isa() == "avx512" else 0)


@pytest.mark.skipif(cl.isa() != "avx512", reason="the runtime takes the prefill kernel on AVX-512 CPUs only")
def test_runtime_greedy_output_unchanged_by_the_kernel(monkeypatch):
    """End to end on the demo pair: prompts prefilled by the kernel or by SDPA decode to the same
    greedy tokens, plain and speculative (batch 2, prompts of different lengths)."""
    t, d = ts.demo.demo_pair("eagle3.1")
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cpu", max_batch_size=2)
    prompts = [r["prompt"] for r in ts.demo.prompt_set("standard")[:2]]
    kernel = rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids
    assert rt.generate(prompts, max_new_tokens=12).token_ids == kernel
    monkeypatch.setattr(cp, "runs", lambda *a: False)
    assert rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids == kernel


@pytest.mark.skipif(cl._compiler() is None, reason="no C compiler here (set CC, or install gcc)")
@pytest.mark.skipif(cl.isa() is None, reason="the CPU lacks AVX2 + FMA: an AVX2 build cannot run here")
def test_avx2_build_matches_reference(tmp_path):
    """The kernel built for AVX2 + FMA (``-march=haswell``: every AVX-512 intrinsic through ``avx2.h``), run on
    this CPU, agrees with the reference, running maximum moves included. The runtime takes the kernel on
    AVX-512 CPUs only, so without this an emulation that ignored a compare's predicate (``avx2.h`` once mapped
    every ``_mm512_cmp_ps_mask`` to ``_CMP_UNORD_Q``: errors of ~3 here) went unseen."""
    import ctypes
    import subprocess

    src = cl.SOURCE.parent / "prefill.c"
    out = tmp_path / "prefill_avx2.so"
    cmd = [cl._compiler(), "-O2", "-march=haswell", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", str(src)]
    r = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    fn = ctypes.CDLL(str(out)).tritonspec_prefill_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, *[i64] * 8, p, *[i64] * 3, p, *[i64] * 3, p, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    g = torch.Generator().manual_seed(4)
    for P, Hq, Hkv, D in [(1, 4, 2, 32), (33, 4, 2, 32), (130, 9, 3, 64), (200, 2, 2, 16)]:
        q, k, v = _case(g, 2, P, Hq, Hkv, D)
        k[:, :, :] += torch.linspace(0, 3, P)[None, :, None, None] * q.mean((1, 2), keepdim=True)  # maxima move
        res = torch.empty(2, P, Hq, D)
        args = [q.data_ptr(), 2, P, Hq, Hkv, D, *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr()]
        assert fn(*args, *v.stride()[:3], res.data_ptr(), D**-0.5, 1) == 0
        ref = cp.cpu_prefill_attention_reference(q, k, v, D**-0.5)
        assert torch.allclose(res, ref, rtol=1e-5, atol=1e-5), (P, Hq, D, (res - ref).abs().max().item())
