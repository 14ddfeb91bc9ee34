"""The AMX path of the CPU prefill attention (``kernels/cpu/prefill.c`` ``tile_amx``, issue 17): float32
operands split exactly into three bfloat16 parts for both products on the tile unit. Close to the float64
reference (as close as the AVX-512 tile, and far closer than bfloat16 alone: the inverse check), over odd prompt
lengths, GQA groups and head dims; the lazy running maximum rescales when scores jump; a prompt's output does not
depend on the batch or the thread count; short prompts and ``set_amx(False)`` keep the AVX-512 tile; greedy
output end to end is unchanged. Skipped where AMX does not run (the reason says why)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_prefill as cp

WHY = cl.available(torch.float32) or cl.amx_available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the AMX prefill path does not run here: {WHY}")
MIN = cp.AMX_MIN_TOKENS


@pytest.fixture(autouse=True)
def amx_on():
    old = cp.set_amx(True)
    yield
    cp.set_amx(old)


def _case(g, B, P, Hq, Hkv, D, scale=1.0):
    return tuple(scale * torch.randn(B, P, h, D, generator=g) for h in (Hq, Hkv, Hkv))


def _run(q, k, v, scale, amx=True, threads=None):
    """(output, whether the AMX path ran)"""
    cp.set_amx(amx)
    before = cp.amx_calls()
    out = cp.cpu_prefill_attention(q, k, v, scale, threads=threads)
    return out, cp.amx_calls() > before


def _err(out, ref):
    return (out.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("P", [MIN, MIN + 1, 161, 257, 600])
@pytest.mark.parametrize(("Hq", "Hkv", "D"), [(4, 2, 32), (9, 3, 64), (8, 1, 96), (2, 2, 128), (1, 1, 256)])
def test_matches_reference_as_closely_as_the_avx512_tile(P, Hq, Hkv, D):
    g = torch.Generator().manual_seed(P * 7 + D)
    q, k, v = _case(g, 2, P, Hq, Hkv, D)
    ref = cp.cpu_prefill_attention_reference(q.double(), k.double(), v.double(), D**-0.5)
    out, ran = _run(q, k, v, D**-0.5)
    avx, ran_avx = _run(q, k, v, D**-0.5, amx=False)
    assert ran and not ran_avx
    assert out.shape == (2, P, Hq, D) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert _err(out, ref) <= 2 * _err(avx, ref) + 1e-7


def test_three_parts_are_needed():
    """The inverse: bfloat16 operands alone (one part) land ~1e-3 from the reference, so the 1e-5 agreement
    above is the split's doing, not a tolerance loose enough for bfloat16."""
    g = torch.Generator().manual_seed(3)
    q, k, v = _case(g, 1, 300, 4, 2, 32, scale=2.0)
    ref = cp.cpu_prefill_attention_reference(q.double(), k.double(), v.double(), 32**-0.5)
    one_part = cp.cpu_prefill_attention_reference(*(t.bfloat16().double() for t in (q, k, v)), 32**-0.5)
    out, ran = _run(q, k, v, 32**-0.5)
    assert ran
    assert _err(one_part, ref) > 1e-3
    assert _err(out, ref) < 2e-5


@pytest.mark.parametrize("order", ["rising", "falling", "jump"])
def test_running_max_moves(order):
    """The lazy maximum: rising scores pass a row's maximum by more than its slack (8 in log2 units) block
    after block, so it moves and rescales acc and the sum many times; falling scores keep the first block's;
    'jump' puts one key 60 above every other late in the prompt. Scores up to ~100: float32 rounds them at
    ~1e-5, hence the tolerance."""
    P, D = 400, 32
    g = torch.Generator().manual_seed(11)
    u = torch.ones(D) / D**0.5
    ramp = torch.arange(P, dtype=torch.float32) * 0.25
    base = {"rising": ramp, "falling": -ramp, "jump": torch.zeros(P)}[order]
    k = base[:, None, None] * u + 0.01 * torch.randn(P, 2, D, generator=g)
    if order == "jump":
        k[300] += 12.0 * u
    q = (5.0 * u).expand(P, 4, D).contiguous() + 0.1 * torch.randn(P, 4, D, generator=g)
    v = torch.randn(P, 2, D, generator=g)
    q, k, v = q[None], k[None], v[None]
    out, ran = _run(q, k, v, 1.0)
    assert ran
    ref = cp.cpu_prefill_attention_reference(q.double(), k.double(), v.double(), 1.0)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4)
    if order == "jump":  # rows from the big key on attend to it almost alone
        assert torch.allclose(out[0, 300:, 0], v[0, 300, 0].expand(100, D), atol=1e-3)


def test_the_future_is_masked():
    g = torch.Generator().manual_seed(5)
    q, k, v = _case(g, 1, 300, 4, 2, 32)
    out, _ = _run(q, k, v, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[:, 200:] += 3.0
    v2[:, 200:] -= 2.0
    out2, ran = _run(q, k2, v2, 0.2)
    assert ran
    assert torch.equal(out[:, :200], out2[:, :200])
    assert not torch.allclose(out[:, 200:], out2[:, 200:])


def test_same_bits_alone_in_a_batch_and_on_two_threads():
    """Each (prompt, head, 16-row tile) is computed on its own: batch neighbours and threads change nothing."""
    g = torch.Generator().manual_seed(8)
    q, k, v = _case(g, 2, 333, 9, 3, 64)
    both, ran = _run(q, k, v, 0.125, threads=2)
    assert ran
    for b in range(2):
        alone, _ = _run(q[b : b + 1], k[b : b + 1], v[b : b + 1], 0.125, threads=1)
        assert torch.equal(alone[0], both[b])


def test_short_prompts_and_the_switch_keep_the_avx512_tile():
    g = torch.Generator().manual_seed(2)
    q, k, v = _case(g, 1, MIN - 1, 4, 2, 32)
    assert not _run(q, k, v, 0.2)[1]
    q, k, v = _case(g, 1, MIN, 2, 2, 16)  # head dim not a multiple of 32
    assert not _run(q, k, v, 0.2)[1]
    q, k, v = _case(g, 1, 2 * MIN, 4, 2, 32)
    assert not _run(q, k, v, 0.2, amx=False)[1]
    assert cp.set_amx(True) is False and cp.set_amx(True) is True


@settings(max_examples=20, deadline=None)
@given(
    B=st.integers(1, 2),
    P=st.integers(MIN, 300),
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    chunks=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_strided_views_of_a_fused_projection(B, P, kv, group, chunks, seed):
    """q, k, v as views of one qkv projection (strided rows and heads), any GQA group and head dim 32..128."""
    g = torch.Generator().manual_seed(seed)
    Hq, D = kv * group, 32 * chunks
    qkv = 2.0 * torch.randn(B, P, (Hq + 2 * kv) * D, generator=g)
    q, k, v = qkv.split([Hq * D, kv * D, kv * D], dim=-1)
    q, k, v = q.view(B, P, Hq, D), k.view(B, P, kv, D), v.view(B, P, kv, D)
    out, ran = _run(q, k, v, D**-0.5)
    assert ran
    ref = cp.cpu_prefill_attention_reference(q.double(), k.double(), v.double(), D**-0.5)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_runtime_greedy_output_unchanged():
    """End to end on the demo pair (prompts of 58-800 tokens): prefilled on AMX or on the AVX-512 tile, the
    same greedy tokens, plain and speculative."""
    t, d = ts.demo.demo_pair("eagle3.1")
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, device="cpu", max_batch_size=2)
    prompts = [r["prompt"] for r in ts.demo.prompt_set("standard")[:4]]
    before = cp.amx_calls()
    amx = rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids
    assert cp.amx_calls() > before
    assert rt.generate(prompts, max_new_tokens=12).token_ids == amx
    cp.set_amx(False)
    assert rt.generate(prompts, max_new_tokens=12, speculative=False).token_ids == amx
