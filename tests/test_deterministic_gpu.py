"""Deterministic mode on a GPU (``runtime/deterministic.py`` with the batch-invariant Triton matmul):
the same end-to-end properties as ``tests/test_deterministic.py`` checks on the CPU, on CUDA, eager
and through CUDA graphs; the inverse (cuBLAS rounds a row differently at M = 1 and M = 64 for some
8B-sized shape) shows the properties are not vacuous there; and ``audit`` passes on the demo pair.

Every test skips without CUDA (``perf/gpu_check.py`` runs this file on a GPU session).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tritonspec as ts
from tritonspec.runtime.audit import generate_recorded

from _util import perm_pair, random_prompts, runtime

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="no GPU: these tests run deterministic mode on a CUDA device")
SPECS = {"chain": ts.SpecConfig.chain(4), "tree": ts.SpecConfig(num_speculative_tokens=4, top_k=3, num_draft_tokens=12)}


def _pair(seed: int):
    return perm_pair("llama", vocab=24, seed=seed, alpha=0.4, target_overrides=dict(num_hidden_layers=4))


def _rt(model, drafter, spec, graphs: bool, dtype=torch.float32, **kw):
    return runtime(
        model,
        drafter,
        spec,
        device="cuda",
        dtype=dtype,
        backend="triton",
        deterministic=True,
        cuda_graphs=graphs,
        max_batch_size=4,
        **kw,
    )


def test_cublas_rounds_a_row_differently_by_row_count():
    """The inverse: in the default mode (cuBLAS) some Llama-3-8B-sized bf16 projection gives row 0 other
    bits at M = 1 than among 64 rows; the batch-invariant matmul gives the same bits."""
    from tritonspec.kernels.batch_invariant_matmul import batch_invariant_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    found = []
    for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=g)
        for m in (1, 2, 8):
            if not torch.equal(F.linear(x[:m], w)[0], F.linear(x, w)[0]):
                found.append((n, k, m))
        assert all(torch.equal(batch_invariant_linear(x[:m], w)[0], batch_invariant_linear(x, w)[0]) for m in (1, 2, 8))
    print(f"cuBLAS row-0 differences (N, K, M vs 64): {found}")
    if not found:  # as tests/test_deterministic.py does for a CPU BLAS that happens to be invariant
        pytest.skip("this GPU's cuBLAS gave row 0 the same bits at M = 1, 2, 8 and 64 for every tried shape")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("shape", sorted(SPECS))
def test_speculative_equals_plain_bit_for_bit_on_gpu(shape, graphs):
    """Greedy speculative tokens and emitted logits equal plain decoding bit for bit over 48 random
    prompts in batches of 4, and alone (the first 8). The recorded runs are eager (the recorder
    reads the host each round); with graphs, the replayed rounds must give the same tokens."""
    model, drafter = _pair(1)
    rt = _rt(model, drafter, SPECS[shape], graphs)
    g = torch.Generator().manual_seed(1)
    prompts = random_prompts(24, torch.randint(1, 25, (48,), generator=g).tolist(), seed=1)
    rounds = 0
    for i in range(0, len(prompts), 4):
        batch = prompts[i : i + 4]
        st, sl = generate_recorded(rt, batch, max_new_tokens=16)
        pt, pl = generate_recorded(rt, batch, max_new_tokens=16, speculative=False)
        assert st == pt
        assert all(torch.equal(a, b) for a, b in zip(sl, pl))
        if graphs:  # replayed (captured) rounds against the recorded eager ones
            assert rt.generate(batch, max_new_tokens=16).token_ids == st
            assert rt.generate(batch, max_new_tokens=16, speculative=False).token_ids == pt
        if i < 8:
            for j, p in enumerate(batch):
                t1, l1 = generate_recorded(rt, [p], max_new_tokens=16)
                assert t1[0] == pt[j] and torch.equal(l1[0], pl[j])
        rounds += rt.generate(batch[:1], max_new_tokens=16).stats.num_drafts
    assert rounds > 30
    if graphs:
        assert rt._graphs is not None and rt._graphs.replays > 30 and not rt._graphs.failed


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_alone_equals_batched_on_gpu(temperature):
    model, drafter = _pair(5)
    prompts = random_prompts(24, [3, 17, 8, 1], seed=7)
    kw = dict(max_new_tokens=24, temperature=temperature, top_p=0.95, seed=[11, 12, 13, 14])
    ref = None
    for shape, spec in [(None, False), ("chain", True), ("tree", True)]:
        rt = _rt(model, drafter, SPECS[shape or "chain"], graphs=True)
        toks, logits = generate_recorded(rt, prompts, speculative=spec, **kw)  # eager (recorded)
        assert rt.generate(prompts, speculative=spec, **kw).token_ids == toks  # through graphs
        for i, p in enumerate(prompts):
            t1, l1 = generate_recorded(rt, [p], speculative=spec, **(kw | {"seed": 11 + i}))
            assert t1[0] == toks[i] and torch.equal(l1[0], logits[i])
            assert rt.generate([p], speculative=spec, **(kw | {"seed": 11 + i})).token_ids[0] == toks[i]
        assert rt._graphs.replays > 0 and not rt._graphs.failed
        if ref is None:
            ref = (toks, logits)
        assert toks == ref[0] and all(torch.equal(a, b) for a, b in zip(logits, ref[1]))


def test_bf16_demo_pair_speculative_equals_plain_and_audit_passes(tmp_path):
    """The demo pair in bf16 on the GPU, deterministic: speculative greedy equals plain (tokens and
    logits) on 8 standard prompts, and ``audit`` (greedy + sampling law) reports no divergence."""
    from tritonspec import demo
    from tritonspec.runtime.audit import audit

    if not demo.available():
        pytest.skip("the demo pair is not built (python -m tritonspec.recipes.demo)")
    target, drafter = demo.ROOT / "target", demo.ROOT / "drafter-eagle3.1"
    rt = ts.SpeculativeRuntime.from_pretrained(
        target, drafter, device="cuda", dtype=torch.bfloat16, deterministic=True, max_batch_size=4, max_seq_len=1024
    )
    prompts = [r["prompt"][-1200:] for r in demo.prompt_set("standard")[:8]]
    for i in range(0, 8, 4):
        st, sl = generate_recorded(rt, prompts[i : i + 4], max_new_tokens=48)
        pt, pl = generate_recorded(rt, prompts[i : i + 4], max_new_tokens=48, speculative=False)
        assert st == pt and all(torch.equal(a, b) for a, b in zip(sl, pl))
    report = audit(
        target, drafter, prompts[:4], max_new_tokens=24, device="cuda", dtype=torch.bfloat16, law_samples=500
    )
    report.write(tmp_path)
    print(report.to_markdown()[:3000])
    assert report.ok
