"""Compiled decode rounds on the CPU (``compile=True``, ``runtime/graphs.py`` backend ``"compile"``):
the round a CUDA graph captures, recorded by ``make_fx`` and compiled by ``torch.compile``, gives
eager's tokens bit for bit (greedy and seeded sampling, plain and speculative, buckets that shrink
and grow); a compile failure warns once and runs eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch

import tritonspec as ts

from _util import perm_pair, random_prompts, runtime

SPEC = ts.SpecConfig(3, 2, 6)


@pytest.fixture(scope="module")
def pair():
    return perm_pair("llama", vocab=24, seed=1, alpha=0.3)


@pytest.fixture(scope="module")
def compiled(pair):
    """One compiled runtime for the module: each (bucket, shape, sampling) key compiles once."""
    return runtime(*pair, spec=SPEC, compile=True, max_seq_len=48, max_batch_size=2)


def test_compiled_rounds_equal_eager(pair, compiled):
    """One bucket, greedy, speculative and plain: two compiled keys (seconds each)."""
    eager = runtime(*pair, spec=SPEC, compile=False, max_seq_len=48, max_batch_size=2)
    assert compiled.compiled and not eager.compiled and not compiled.graphs_enabled
    prompt = random_prompts(24, [5], seed=4)
    for speculative in (True, False):
        a = eager.generate(prompt, max_new_tokens=30, speculative=speculative)
        b = compiled.generate(prompt, max_new_tokens=30, speculative=speculative)
        assert b.token_ids == a.token_ids and b.finish_reasons == a.finish_reasons
    assert b.token_ids == compiled.generate(prompt, max_new_tokens=30).token_ids  # lossless: spec == plain
    g = compiled._graphs
    assert not g.failed and g.replays > 10 and {k[0] for k in g.graphs} == {1}
    # the replayed artefacts are torch.compile's, not the recorded aten graph run as it is
    assert all(isinstance(fn, torch._dynamo.eval_frame.OptimizedModule) for fn in g.graphs.values())


@pytest.mark.slow
def test_compiled_rounds_equal_eager_over_buckets_and_sampling(pair, compiled):
    """Buckets that shrink and grow, greedy and seeded sampling (eight compiled keys: minutes)."""
    eager = runtime(*pair, spec=SPEC, compile=False, max_seq_len=48, max_batch_size=2)
    prompts = random_prompts(24, [5, 20], seed=4)
    # two rows, then one (the longer prompt reaches max_seq_len first: the bucket shrinks), then two
    for batch in (prompts, prompts[:1], prompts):
        for kw in (dict(), dict(temperature=1.0, seed=[3, 4][: len(batch)])):
            for speculative in (True, False):
                a = eager.generate(batch, max_new_tokens=40, speculative=speculative, **kw)
                b = compiled.generate(batch, max_new_tokens=40, speculative=speculative, **kw)
                assert b.token_ids == a.token_ids and b.finish_reasons == a.finish_reasons
    assert not compiled._graphs.failed and {k[0] for k in compiled._graphs.graphs} == {1, 2}


def test_kv_bucket_rounds_the_attention_bound_up(pair, monkeypatch):
    """A compiled round's attention bound: longest row + the most slots a round adds, to a power
    of two of at least KV_BUCKET_MIN; None (the whole cache) once that reaches a cache's end."""
    from tritonspec.runtime import decode

    monkeypatch.setattr(decode, "KV_BUCKET_MIN", 8)
    rt = runtime(*pair, spec=SPEC, max_seq_len=48, max_batch_size=2)
    dec = rt.decoder
    with torch.inference_mode():
        dec.prefill(random_prompts(24, [5, 2], seed=1), speculative=True)
    extra = max((SPEC.num_speculative_tokens - 1) * SPEC.top_k, SPEC.num_draft_tokens, SPEC.num_speculative_tokens + 2)
    assert dec.lengths == [5, 2] and extra == 6
    assert dec.kv_bucket() == 16  # 5 + 6 = 11 -> 16
    dec.lengths = [1, 1]
    assert dec.kv_bucket() == 8  # 7 -> the minimum
    dec.lengths = [10, 2]
    assert dec.kv_bucket() == 16  # 16 exactly
    dec.lengths = [11, 30]
    assert dec.kv_bucket() is None  # 36 -> 64, past the 55-slot target cache: the whole cache
    dec.speculative = False
    dec.lengths = [20, 3]
    assert dec.kv_bucket() == 32  # plain rounds add 2 slots at most: 22 -> 32


def test_compiled_rounds_over_growing_kv_buckets_equal_eager(pair, monkeypatch):
    """A request that grows through several attention bounds compiles one round per bound, and
    its tokens equal eager rounds' (which attend up to the exact lengths). Compiled without the C++
    wrapper (what is tested here is the bound, and it compiles three keys 5x faster)."""
    from tritonspec.runtime import decode, graphs

    monkeypatch.setattr(decode, "KV_BUCKET_MIN", 8)
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {})
    rt = runtime(*pair, spec=SPEC, compile=True, max_seq_len=48, max_batch_size=1)
    eager = runtime(*pair, spec=SPEC, compile=False, max_seq_len=48, max_batch_size=1)
    prompt = random_prompts(24, [5], seed=4)
    a = eager.generate(prompt, max_new_tokens=36)
    b = rt.generate(prompt, max_new_tokens=36)
    assert b.token_ids == a.token_ids and b.finish_reasons == a.finish_reasons
    assert {k[-1] for k in rt._graphs.graphs} == {16, 32, None} and not rt._graphs.failed


def test_compile_failure_warns_once_and_runs_eager(pair, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    rt = runtime(*pair, spec=SPEC, compile=True, max_seq_len=48, max_batch_size=1)
    eager = runtime(*pair, spec=SPEC, compile=False, max_seq_len=48, max_batch_size=1)
    prompt = random_prompts(24, [6], seed=1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = rt.generate(prompt, max_new_tokens=20)
        rt.generate(prompt, max_new_tokens=20)
    msgs = [str(w.message) for w in rec if "torch.compile of the decode round failed" in str(w.message)]
    assert len(msgs) == 1 and "no C++ compiler" in msgs[0]
    assert out.token_ids == eager.generate(prompt, max_new_tokens=20).token_ids


def test_compile_option_is_validated(pair):
    with pytest.raises(ValueError, match="compile='yes'"):
        runtime(*pair, compile="yes")
    assert not runtime(*pair).compiled  # "auto" on a CPU: eager
