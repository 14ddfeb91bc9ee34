"""CUDA graphs against eager decoding, end to end, and what one decode round costs.

    python -m pytest perf/bench_graphs.py --benchmark-json perf/graphs.json   # on a GPU (perf/gpu_check.py)
    python -m pytest perf/bench_graphs.py --benchmark-disable                  # CI: CPU, eager rows only

Rows: pair x mode (plain / speculative) x runner (eager / graphs / graphs-det: graphs with
``deterministic=True``, the batch-invariant matmul). ``extra_info``: tokens/s, τ,
rounds, decode ms per round, prefill ms, and from an eager profile of the same pair: draft /
verify / commit ms per round (device synchronised after each phase), device kernel launches
per round (``torch.profiler``, CUDA only; a graph replays the same kernels in one launch) and the
aten ops one round dispatches (any device).

Pairs: ``demo`` (the bundled target with its EAGLE-3.1 drafter; its τ is real) and
``llama3-8b-random`` (random bf16 weights in Llama-3-8B shapes with a random EAGLE-3.1 drafter,
draft vocabulary 32K): a cost model only, its τ is ~1 and its speedup meaningless;
``perf/gpu_check.py`` combines its round costs with the demo pair's τ into a *projected* speedup.
Without CUDA the graph rows and the 8B pair skip; the demo eager rows run (few tokens in CI).
"""

from __future__ import annotations

import pytest
import torch

from tritonspec.runtime.bench import environment, round_profile, timed_generate

CUDA = torch.cuda.is_available()
PAIRS = ("demo", "llama3-8b-random")
_cache: dict = {}


def llama3_8b_random(device: str = "cuda"):
    """A random-weight target with Llama-3-8B's shapes (bf16) and a random EAGLE-3.1 drafter."""
    from transformers import LlamaConfig

    import tritonspec as ts
    from tritonspec.runtime.target import TargetModel

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02

    H, I, kv = 4096, 14336, 8 * 128
    state = {
        "embed_tokens.weight": w(cfg.vocab_size, H),
        "norm.weight": torch.ones(H, device=device),
        "lm_head.weight": w(cfg.vocab_size, H),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(H, device=device),
            p + "post_attention_layernorm.weight": torch.ones(H, device=device),
            p + "self_attn.q_proj.weight": w(H, H),
            p + "self_attn.k_proj.weight": w(kv, H),
            p + "self_attn.v_proj.weight": w(kv, H),
            p + "self_attn.o_proj.weight": w(H, H),
            p + "mlp.gate_proj.weight": w(I, H),
            p + "mlp.up_proj.weight": w(I, H),
            p + "mlp.down_proj.weight": w(H, I),
        }
    target = TargetModel(cfg, state, torch.device(device), torch.bfloat16)
    drafter = ts.Eagle3Drafter.for_target(cfg, draft_vocab_size=32000, seed=0)
    return target, drafter


def _runtime(pair: str, graphs: bool, quick: bool, deterministic: bool = False):
    import tritonspec as ts
    from tritonspec import demo

    dev = "cuda" if CUDA else "cpu"
    if pair == "demo":
        if not demo.available():
            pytest.skip("the demo pair is not built (python -m tritonspec.recipes.demo)")
        if "demo" not in _cache:
            _cache["demo"] = (demo.ROOT / "target", ts.Eagle3Drafter.from_pretrained(demo.ROOT / "drafter-eagle3.1"))
        target, drafter = _cache["demo"]
        rt = ts.SpeculativeRuntime.from_pretrained(
            target,
            drafter,
            device=dev,
            spec=ts.SpecConfig(),
            max_batch_size=4,
            max_seq_len=1024,
            cuda_graphs=graphs,
            deterministic=deterministic,
        )
        prompts = [rt.tokenizer(r["prompt"])["input_ids"] for r in demo.prompt_set("standard")[:4]]
        return rt, prompts, (8 if quick else 128)
    if not CUDA:
        pytest.skip("no GPU: the Llama-3-8B-shaped target (16 GB of bf16 weights) runs on CUDA only")
    if pair not in _cache:
        _cache[pair] = llama3_8b_random()
    target, drafter = _cache[pair]
    rt = ts.SpeculativeRuntime(
        target,
        drafter,
        spec=ts.SpecConfig(),
        max_batch_size=4,
        max_seq_len=2048,
        cuda_graphs=graphs,
        deterministic=deterministic,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128256, (512,), generator=g).tolist() for _ in range(4)]
    return rt, prompts, 128


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("runner", ["eager", "graphs", "graphs-det"])
@pytest.mark.parametrize("mode", ["plain", "speculative"])
@pytest.mark.parametrize("pair", PAIRS)
def test_graphs_vs_eager(benchmark, pair, mode, runner, batch, request):
    if runner != "eager" and not CUDA:
        pytest.skip("no GPU: CUDA graphs need a CUDA device")
    quick = request.config.getoption("benchmark_disable", False)
    if quick:
        torch.set_num_threads(1)
    graphs = runner != "eager"
    rt, prompts, tokens = _runtime(pair, graphs, quick, deterministic=runner == "graphs-det")
    prompts = prompts[:batch]
    spec = mode == "speculative"
    if graphs:  # capture every bucket the batch can shrink to, before timing
        rt.warmup([b for b in rt._graphs.sizes if b <= rt._graphs.bucket(batch)], speculative=spec)
        captures = rt._graphs.captures
    timed_generate(rt, prompts, min(tokens, 8), spec)  # warm-up (JIT, allocator)
    results = []
    benchmark.pedantic(
        lambda: results.append(timed_generate(rt, prompts, tokens, spec)), rounds=1, iterations=1, warmup_rounds=0
    )
    r = results[-1]
    prof = round_profile(rt, prompts, spec, rounds=2 if quick else 8)
    info = (
        dict(
            pair=pair, mode=mode, runner=runner, batch=batch, spec=str(rt.spec) if spec else "-", max_new_tokens=tokens
        )
        | r
        | prof
    )
    if graphs:
        info |= dict(
            graphs_captured=rt._graphs.captures,
            graph_failures=len(rt._graphs.failed),
            captured_while_timed=rt._graphs.captures - captures,
        )
        assert not rt._graphs.failed, "a CUDA-graph capture failed (see the warning)"
    benchmark.extra_info.update(info | {"device": environment().get("device", "cpu")})
    assert r["new_tokens"] == len(prompts) * tokens
    assert prof["profiled_rounds"] > 0 and prof["verify_ms"] > 0 and prof["aten_ops"] > 0
    assert (prof["launches"] is not None) == CUDA
