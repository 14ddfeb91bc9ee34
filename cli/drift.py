"""``tritonspec drift``: attention drift per draft depth (EAGLE-3 vs 3.1), written as JSON + PNG
plots by ``runtime.drift``."""

from __future__ import annotations

import argparse

from .common import add_command, is_demo


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``drift`` subcommand to ``subparsers`` and return its parser."""
    dr = add_command(
        subparsers,
        "drift",
        "measure attention drift per draft depth (EAGLE-3 vs 3.1), JSON + PNG plots",
        """examples:
  tritonspec drift --target ./llama --drafter ./eagle3 --drafter ./eagle3.1 --prompts prompts.jsonl --out drift/
  tritonspec drift --target demo --prompts demo/prompts/long.jsonl --num-prompts 20 --out drift-long/""",
    )
    dr.add_argument("--target", required=True, help="HF target directory, or 'demo' (both demo drafters)")
    dr.add_argument("--drafter", action="append", default=[], help="drafter directory (repeatable)")
    dr.add_argument("--prompts", required=True, help="JSONL (prompt/text field) or text file (blank-line separated)")
    dr.add_argument("--out", required=True)
    dr.add_argument("--num-prompts", type=int, default=None)
    dr.add_argument("--max-new-tokens", type=int, default=64)
    dr.add_argument("--depth", type=int, default=6, help="chain depth measured (default 6)")
    dr.add_argument("--n-sink", type=int, default=1, help="leading slots counted as the attention sink")
    dr.add_argument("--device", default="cpu")
    dr.set_defaults(fn=cmd_drift)
    return dr


def cmd_drift(args: argparse.Namespace) -> int:
    import tritonspec as ts

    from ..runtime.drift import measure_drift, read_prompts, write_report

    target, drafters, names = args.target, list(args.drafter), None
    if is_demo(target):
        from ..demo import demo_pair

        target = str(demo_pair("eagle3")[0])
        if not drafters:  # the bundled pair's drafters, by their variant names (not this machine's paths)
            names = ["eagle3", "eagle3.1"]
            drafters = [str(demo_pair(v)[1]) for v in names]
    if not drafters:
        raise ValueError("pass at least one --drafter")
    prompts = read_prompts(args.prompts, args.num_prompts)
    report = measure_drift(
        target,
        drafters,
        prompts,
        spec=ts.SpecConfig.chain(args.depth),
        max_new_tokens=args.max_new_tokens,
        n_sink=args.n_sink,
        names=names,
        device=args.device,
    )
    files = write_report(report, args.out)
    print(report.summary())
    print(f"wrote {', '.join(f.name for f in files)} to {args.out}")
    return 0
