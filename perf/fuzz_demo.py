"""Differential fuzz on the bundled demo pair (a script, not a suite): random runtimes and requests checked
against plain decoding of each prompt alone, for as long as you give it. ``tests/test_fuzz_runtime.py`` is the
CI-sized version on a tiny pair; this one runs the real demo pair, its shipped profiles and stop strings.

    python perf/fuzz_demo.py runtime --seed 11 --minutes 20   # shapes x batches x modes x budgets x stops
    python perf/fuzz_demo.py stop --seed 1 --minutes 10       # stop strings cut from the plain output

``runtime``: each iteration builds a runtime (EAGLE-3 or EAGLE-3.1, a random chain or tree or ``spec=None``, a
prompt-lookup branch, ``max_batch_size`` 1-4, deterministic mode, adaptive shapes) and sends it three requests
(1 to 2 x batch + 2 prompts from the three demo sets plus a few tiny ones, per-prompt budgets, stop tokens,
greedy or seeded sampling at temperature 0.7 / 1 with top-p / top-k, one in five a ``stream``). Greedy rows and
deterministic-mode rows must equal plain decoding of the prompt alone; seeded sampled rows at a fixed shape the
same runtime's solo run (with ``spec=None`` the tuned shape depends on the batch, so a sampled row is not compared).
``stop``: stop strings drawn from the plain output's text (and ``"\\n"``); four speculative runtimes (the profile,
a chain of 7, a (4,3,12) tree, a chain with a lookup branch) must give plain decoding's text, tokens and finish
reason, and a stream's joined text must equal it. One thread; prints every mismatch and the final counts (rows
compared, mismatches), exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

import torch

import tritonspec as ts
from tritonspec import demo
from tritonspec.runtime.config import SpecConfig


def _prompts() -> list[str]:
    rows = [r["prompt"] for name in demo.PROMPT_SETS for r in demo.prompt_set(name)]
    return [p for p in rows if len(p) < 2500] + ["x", "def f(", "\n\n", "import os\nimport sys\n"]


def _random_spec(R: random.Random) -> SpecConfig | None:
    c = R.random()
    if c < 0.2:
        return None
    if c < 0.45:
        spec = SpecConfig.chain(R.randint(1, 8))
    else:
        depth, top_k = R.randint(1, 7), R.randint(1, 4)
        most = SpecConfig(num_speculative_tokens=depth, top_k=top_k, num_draft_tokens=2).max_candidates
        spec = SpecConfig(num_speculative_tokens=depth, top_k=top_k, num_draft_tokens=R.randint(2, min(most, 40) + 1))
    if R.random() < 0.4:
        longest = R.randint(1, 5)
        spec = dataclasses.replace(
            spec,
            prompt_lookup_num_tokens=R.randint(1, 8),
            prompt_lookup_max=longest,
            prompt_lookup_min=R.randint(1, longest),
        )
    return spec


def fuzz_runtime(R: random.Random, end: float) -> tuple[int, int, int]:
    prompts = _prompts()
    pairs = {v: demo.demo_pair(v) for v in ("eagle3.1", "eagle3")}
    solo: dict[tuple, list[int]] = {}
    it = fails = compared = 0
    while time.time() < end:
        it += 1
        variant, det, mb, adaptive, spec = (
            R.choice(list(pairs)),
            R.random() < 0.3,
            R.choice([1, 2, 3, 4]),
            R.random() < 0.7,
            _random_spec(R),
        )
        desc = dict(it=it, variant=variant, deterministic=det, max_batch_size=mb, adaptive=adaptive, spec=spec)
        rt = ts.SpeculativeRuntime.from_pretrained(
            *pairs[variant], max_batch_size=mb, max_seq_len=2048, deterministic=det, adaptive_shape=adaptive, spec=spec
        )
        plain = ts.SpeculativeRuntime.from_pretrained(
            pairs[variant][0], None, max_batch_size=1, max_seq_len=2048, deterministic=det
        )
        for req in range(3):
            nb = R.randint(1, 2 * mb + 2)
            ps = [R.choice(prompts) for _ in range(nb)]
            ns = [R.choice([1, 2, 5, 17, 40, 64, 90]) for _ in range(nb)]
            seeds = [R.randint(0, 10**6) for _ in range(nb)]
            temp = R.choice([0.0, 0.0, 0.7, 1.0])
            kw: dict = {}
            if temp > 0:
                kw = dict(temperature=temp, top_p=R.choice([1.0, 0.9]), top_k=R.choice([0, 0, 20]))
            stops = R.choice([None, [], [R.randint(0, 4095) for _ in range(3)]])
            if stops is not None:
                kw["stop_token_ids"] = stops
            if nb == 1 and R.random() < 0.2:
                pieces = list(rt.stream(ps[0], max_new_tokens=ns[0], seed=seeds[0], **kw))
                rows = [[t for piece in pieces for t in piece.token_ids]]
            else:
                rows = rt.generate(ps, max_new_tokens=ns, seed=seeds, **kw).token_ids
            for i, p in enumerate(ps):
                if temp == 0 or det:
                    key = (variant, det, p, ns[i], seeds[i] if temp else None, repr(sorted(kw.items())))
                    if key not in solo:
                        one = plain.generate([p], max_new_tokens=ns[i], seed=seeds[i], speculative=False, **kw)
                        solo[key] = one.token_ids[0]
                    ref = solo[key]
                elif spec is not None:
                    ref = rt.generate([p], max_new_tokens=ns[i], seed=seeds[i], **kw).token_ids[0]
                else:
                    continue
                compared += 1
                if ref != rows[i]:
                    fails += 1
                    print("MISMATCH", desc, dict(req=req, row=i, budgets=ns, temperature=temp, kw=kw), flush=True)
        if it % 10 == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {it} runtimes, {fails} mismatches", flush=True)
    return it, compared, fails


def fuzz_stop(R: random.Random, end: float) -> tuple[int, int, int]:
    prompts = [p for p in _prompts() if len(p) > 20]
    target, drafter = demo.demo_pair("eagle3.1")
    plain = ts.SpeculativeRuntime.from_pretrained(target, None, max_batch_size=1)
    specs = [
        None,
        SpecConfig.chain(7),
        SpecConfig(num_speculative_tokens=4, top_k=3, num_draft_tokens=12),
        dataclasses.replace(SpecConfig.chain(3), prompt_lookup_num_tokens=6),
    ]
    rts = [
        ts.SpeculativeRuntime.from_pretrained(target, drafter, max_batch_size=R.choice([1, 2, 4]), spec=s)
        for s in specs
    ]
    it = fails = compared = 0
    while time.time() < end:
        it += 1
        ps = [R.choice(prompts) for _ in range(R.randint(1, 5))]
        n = R.choice([16, 40, 64])
        stops = []
        for text in (plain.generate([p], max_new_tokens=n).texts[0] for p in ps):
            if len(text) > 4 and R.random() < 0.8:
                a = R.randint(0, len(text) - 2)
                stops.append(text[a : a + R.randint(1, 6)])
        if R.random() < 0.3:
            stops.append("\n")
        stops = [s for s in stops if s] or ["zzzz"]
        refs = [plain.generate([p], max_new_tokens=n, stop=stops) for p in ps]
        k = R.randrange(len(rts))
        out = rts[k].generate(ps, max_new_tokens=n, stop=stops)
        for i, r in enumerate(refs):
            compared += 1
            want = (r.texts[0], r.token_ids[0], r.finish_reasons[0])
            if want != (out.texts[i], out.token_ids[i], out.finish_reasons[i]):
                fails += 1
                print("MISMATCH", specs[k], stops, repr(want[0][-40:]), repr(out.texts[i][-40:]), flush=True)
        if len(ps) == 1 or R.random() < 0.3:
            pieces = list(rts[k].stream(ps[0], max_new_tokens=n, stop=stops))
            if (
                "".join(p.text for p in pieces) != refs[0].texts[0]
                or pieces[-1].finish_reason != refs[0].finish_reasons[0]
            ):
                fails += 1
                print("STREAM MISMATCH", specs[k], stops, flush=True)
        if it % 50 == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {it} requests, {fails} mismatches", flush=True)
    return it, compared, fails


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["runtime", "stop"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=10.0)
    args = ap.parse_args(argv)
    if not demo.available():
        print("the demo pair is not built here (demo/README.md)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    run = fuzz_runtime if args.mode == "runtime" else fuzz_stop
    n, compared, fails = run(random.Random(args.seed), time.time() + 60 * args.minutes)
    unit = "runtimes" if args.mode == "runtime" else "requests"
    print(f"done: {n} {unit}, {compared} rows compared, {fails} mismatches")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
