"""SmolLM2, 2 threads, batch 1, 2 chat prompts x 48 tokens twice: eager against compiled rounds,
plain and EAGLE-3.1 (the shipped drafter on the shipped profile's shape for the dtype), and the
weights-read-once bound measured in the same run with ``bench_cpu_decode.py``'s helpers. The quick
form of that benchmark's compiled rows (``perf/CPU_DECODE.md``):

    python perf/compiled_smollm2.py              # float32 (kn weights); ~10 min on 2 cores, most of it compiling
    python perf/compiled_smollm2.py bfloat16     # bfloat16 (nk weights, the dtype's default layout)
"""

import sys
import time
from pathlib import Path

import torch

import tritonspec as ts

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_decode import PROMPTS, read_rate_gbps, step_weights

from tritonspec.drafters import shipped_drafter
from tritonspec.runtime.gguf import resolve_target
from tritonspec.runtime.weights import load_tokenizer

torch.set_num_threads(2)
t = resolve_target("smollm2")
d = shipped_drafter("smollm2", "eagle3.1")
tok = load_tokenizer(t)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
tm = ts.TargetModel.from_pretrained(t, dtype=dtype)  # the dtype's default layout: kn for float32, nk for bfloat16
print("dtype", dtype, "weight layout", tm.weight_layout, flush=True)
dr = ts.Eagle3Drafter.from_pretrained(d)
rts = {}
for comp in (False, True):
    rts[f"plain-{'c' if comp else 'e'}"] = ts.SpeculativeRuntime(tm, None, tok, max_batch_size=1, compile=comp)
    rts[f"spec-{'c' if comp else 'e'}"] = ts.SpeculativeRuntime(tm, dr, tok, max_batch_size=1, compile=comp)
t0 = time.perf_counter()
for name, rt in rts.items():
    for p in PROMPTS:
        rt.generate(p, max_new_tokens=3, speculative=name.startswith("spec"), stop_token_ids=[])
print("warm/compile s", round(time.perf_counter() - t0, 1), "spec", rts["spec-c"].spec, flush=True)
ms = {k: [] for k in rts}
taus = []
toks = {k: [] for k in rts}
for _ in range(2):  # two passes, interleaved per prompt
    for p in PROMPTS:
        for name, rt in rts.items():
            a = time.perf_counter()
            out = rt.generate(p, max_new_tokens=48, speculative=name.startswith("spec"), stop_token_ids=[])
            ms[name].append((time.perf_counter() - a) / out.stats.num_new_tokens * 1e3)
            toks[name].append(out.token_ids[0])
            if name == "spec-c":
                taus.append(out.stats.mean_acceptance_length)
w = step_weights(tm)
g = read_rate_gbps(w)
nb = sum(x.numel() * x.element_size() for x in w)
bound = nb / (g * 1e9) * 1e3
res = {k: round(sum(v) / len(v), 2) for k, v in ms.items()}
print("ms/token", res, "tau", round(sum(taus) / len(taus), 2), "bound", round(bound, 2), f"({g:.1f} GB/s)")
print("plain-c / bound", round(res["plain-c"] / bound, 2), "plain-e / bound", round(res["plain-e"] / bound, 2))
print("identical", {k: v == toks["plain-e"] for k, v in toks.items()})
