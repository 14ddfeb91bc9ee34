"""``tritonspec audit``: a rerunnable certificate of deterministic mode for a prompt set
(``runtime/audit.py``): bit-identity with and without speculation, alone and batched, and the
sampling law; a Markdown and a JSON report; exit status 1 on any divergence."""

from __future__ import annotations

import argparse
import sys

from .common import add_command, default_target, demo_prompts, parse_dtype, resolve_pair, spec_from_flags


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``audit`` subcommand to ``subparsers`` and return its parser."""
    a = add_command(
        subparsers,
        "audit",
        "certify deterministic mode on a prompt set: bit-identical outputs and logits, sampling law; MD + JSON",
        """examples:
  tritonspec audit                                            # demo pair, 8 standard prompts, out: audit/
  tritonspec audit --target ./llama --drafter ./eagle3 --prompts prompts.jsonl --num-prompts 20 --out audit-llama
  tritonspec audit --temperature 0 --max-new-tokens 64        # greedy only, no sampling-law test

In deterministic mode every prompt runs plain and speculative, alone and in batches of --batch-size; the
tokens and the logits of every emitted token must be bit-identical across the four. At --temperature > 0
the same holds for seeded sampling, and a chi-square test checks the first tokens' law over
--law-samples seeds. The report (audit.md, audit.json) lists the sha256 of every model file, versions,
device, settings and a verdict per prompt: rerun it elsewhere and compare. Exit status: 0 pass, 1 any
divergence, 2 bad input.""",
    )
    a.add_argument("--target", default=default_target(), help="HF target directory, 'demo' (default) or 'tiny-random'")
    a.add_argument("--drafter", default=None, help="drafter directory (default: the demo's / tiny pair's)")
    a.add_argument("--prompts", default=None, help="JSONL (prompt/text field) or text file; default: the demo set")
    a.add_argument("--prompt-set", default="standard", help="bundled demo set when --prompts is not given")
    a.add_argument("--num-prompts", type=int, default=8)
    a.add_argument("--max-new-tokens", type=int, default=32)
    a.add_argument("--batch-size", type=int, default=4)
    a.add_argument("--temperature", type=float, default=0.8, help="sampled mode's temperature (0: greedy only)")
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    a.add_argument("--law-samples", type=int, default=2000, help="seeds per sampling-law test (0: skip)")
    a.add_argument("--law-prompts", type=int, default=2, help="prompts given a sampling-law test")
    a.add_argument("--num-speculative-tokens", type=int, default=None)
    a.add_argument("--draft-top-k", type=int, default=None)
    a.add_argument("--num-draft-tokens", type=int, default=None)
    a.add_argument("--prompt-lookup-num-tokens", type=int, default=None, help="a prompt-lookup branch (0 = none)")
    a.add_argument("--prompt-lookup-min", type=int, default=None, help="the shortest suffix it matches (default 2)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--dtype", default=None)
    a.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    a.add_argument("--max-seq-len", type=int, default=None)
    a.add_argument("--out", default="audit", help="folder for audit.md and audit.json (default: audit/)")
    a.set_defaults(fn=cmd_audit)
    return a


def cmd_audit(args: argparse.Namespace) -> int:
    from ..runtime.audit import audit
    from ..runtime.drift import read_prompts
    from ..runtime.errors import UserError

    for flag in ("num_prompts", "max_new_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    target, drafter = resolve_pair(args.target, args.drafter)
    prompts = read_prompts(args.prompts, args.num_prompts) if args.prompts else demo_prompts(args.prompt_set)
    report = audit(
        target,
        drafter,
        prompts[: args.num_prompts],
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        spec=spec_from_flags(
            args.num_speculative_tokens,
            args.draft_top_k,
            args.num_draft_tokens,
            args.prompt_lookup_num_tokens,
            args.prompt_lookup_min,
        ),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        law_samples=args.law_samples,
        law_prompts=args.law_prompts,
        device=args.device,
        dtype=parse_dtype(args.dtype),
        backend=args.backend,
        max_seq_len=args.max_seq_len,
    )
    files = report.write(args.out)
    bad = [v for v in report.verdicts if not v.ok]
    laws = [x for x in report.laws if not x.ok]
    print(
        f"[tritonspec audit] {'PASS' if report.ok else 'FAIL'}: {len(report.verdicts)} prompt runs, "
        f"{len(bad)} diverging; {len(report.laws)} sampling-law tests, {len(laws)} failing; "
        f"{sum(len(f) for f in report.files.values())} files hashed; {report.wall_time_s:.1f} s"
    )
    for v in bad:
        print(f"  prompt {v.prompt} ({v.mode}): {v.first_divergence}", file=sys.stderr)
    for x in laws:
        print(
            f"  sampling law, prompt {x.prompt} {x.token}: p={x.p_value:.3g} impossible={x.impossible}", file=sys.stderr
        )
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0 if report.ok else 1
