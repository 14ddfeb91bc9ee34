"""``tritonspec bench``: a quick side-by-side throughput table (ours vs transformers) on the same
prompts, through ``runtime.bench``; the full reports are the perf/ suites."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import DEMO, add_command, demo_prompts, is_demo


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers`` and return its parser."""
    b = add_command(
        subparsers,
        "bench",
        "quick side-by-side throughput table (ours vs transformers), same prompts",
        """examples:
  tritonspec bench                                   # demo pair, standard set, 4 prompts x 32 tokens, greedy
  tritonspec bench --sets standard,long,perturbed --systems ours-plain,ours-eagle3,ours-eagle3.1 --temperature 1
  tritonspec bench --target ./llama --drafter eagle3=./eagle3 --prompts p.jsonl
full reports: python -m pytest perf/bench_e2e.py --benchmark-json perf/e2e.json &&
              python perf/report.py perf/e2e.json""",
    )
    b.add_argument("--target", default=DEMO)
    b.add_argument("--drafter", action="append", default=[], help="NAME=DIR (repeatable), for a --target directory")
    b.add_argument("--draft-lm", default=None, help="draft LM directory for hf-assisted")
    b.add_argument("--prompts", default=None, help="prompt file for a --target directory")
    b.add_argument("--sets", default="standard", help="demo prompt sets, comma separated")
    b.add_argument("--systems", default="ours-plain,hf-greedy,ours-eagle3,ours-eagle3.1")
    b.add_argument("--num-prompts", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--max-seq-len", type=int, default=None, help="default: the target's, at most 4096")
    b.add_argument("--device", default="cpu")
    b.set_defaults(fn=cmd_bench)
    return b


def cmd_bench(args: argparse.Namespace) -> int:
    from ..runtime.bench import SYSTEMS, Bench, format_table
    from ..runtime.errors import UserError

    for flag in ("num_prompts", "max_new_tokens", "batch"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    systems = args.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    if is_demo(args.target):
        from .. import demo

        target, d3 = demo.demo_pair("eagle3")
        drafters = {"eagle3": d3, "eagle3.1": demo.demo_pair("eagle3.1")[1]}
        draft_lm = demo.ROOT / "draft-lm"
        sets = {name: demo_prompts(name) for name in args.sets.split(",")}
    else:
        if not args.prompts:
            raise ValueError("--prompts FILE is needed with a --target other than the demo pair")
        from ..runtime.drift import read_prompts

        target, draft_lm = args.target, args.draft_lm
        drafters = dict(d.split("=", 1) for d in args.drafter)
        sets = {Path(args.prompts).stem: read_prompts(args.prompts)}
    bench = Bench(target, drafters, draft_lm, max_seq_len=args.max_seq_len, device=args.device)
    results = []
    runnable = [s for s in systems if bench.available(s, args.batch) is None]
    for s in systems:
        if s not in runnable:
            print(f"# {s}: skipped ({bench.available(s, args.batch)})")
    for name, prompts in sets.items():  # the systems interleaved prompt by prompt (Bench.run_interleaved)
        res = bench.run_interleaved(
            runnable, prompts[: args.num_prompts], name, args.temperature, args.batch, args.max_new_tokens
        )
        results += res.values()
    print(format_table(results))
    return 0
