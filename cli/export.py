"""``tritonspec export``: re-save a drafter as ``LlamaForCausalLMEagle3`` or speculators format, with
a compatibility report per serving system (``runtime/serving.py`` holds the rules it applies)."""

from __future__ import annotations

import argparse

from .common import add_command, parse_dtype, resolve_pair


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers`` and return its parser."""
    e = add_command(
        subparsers,
        "export",
        "re-save a drafter as LlamaForCausalLMEagle3 or speculators format, checked against vLLM and SGLang",
        """examples:
  tritonspec export --drafter ./yuhuili-eagle3 --target ./Llama-3.1-8B-Instruct --out ./eagle3-sglang
  tritonspec export --drafter ./my-drafter --out ./my-drafter-spec --format speculators --target ./llama --dtype bf16
  tritonspec export --drafter ./my-eagle3.1 --out ./for-vllm --for vllm

Before writing, a report says per serving system and loader version read whether the drafter loads as
trained, loads but would ignore a trained switch (the export is then refused unless --force), or fails to
load; it is printed and written next to the checkpoint (serving_compatibility.md). Official SafeAILab
checkpoints record no aux layer ids: pass --target so that EAGLE's (2, N//2, N-3) are filled in.""",
    )
    e.add_argument("--drafter", required=True, help="drafter directory (official, LlamaForCausalLMEagle3, speculators)")
    e.add_argument("--out", required=True, help="output directory; a non-empty one is refused unless --overwrite")
    e.add_argument("--format", default="eagle3", choices=["eagle3", "speculators"])
    e.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as loaded)")
    e.add_argument("--aux-layer-convention", default="auto", choices=["auto", "boundary", "post_layer"])
    e.add_argument(
        "--target",
        default=None,
        help="the target model (directory, Hugging Face id or 'demo'): fills verifier.name_or_path, rope settings, "
        "max_position_embeddings and, for official checkpoints, the aux layer ids",
    )
    e.add_argument(
        "--for",
        dest="serving",
        default="all",
        choices=["vllm", "sglang", "all"],
        help="the serving systems to check the export against (default: all)",
    )
    e.add_argument(
        "--force", action="store_true", help="write even if a serving system would load it but ignore a switch"
    )
    e.add_argument("--overwrite", action="store_true", help="replace the drafter files of a non-empty --out")
    e.set_defaults(fn=cmd_export)
    return e


def cmd_export(args: argparse.Namespace) -> int:
    import tritonspec as ts

    from ..runtime.checkpoint import plan_export

    d = ts.Eagle3Drafter.from_pretrained(args.drafter, aux_layer_convention=args.aux_layer_convention)
    target = resolve_pair(args.target, None)[0] if args.target else None
    plan = plan_export(d.config, args.format, target=target, target_info=d.target_info, serving=args.serving)
    print(plan.report.table())
    refusals = plan.refusals()
    if refusals and args.force:
        print("--force: writing although " + "; ".join(refusals))
    out = d.save_pretrained(
        args.out,
        format=args.format,
        dtype=parse_dtype(args.dtype),
        target=target,
        serving=args.serving,
        force=args.force,
        overwrite=bool(args.overwrite),
    )
    c = plan.config
    print(
        f"wrote {args.format} drafter to {out} (fc_norm={c.fc_norm}, norm_output={c.norm_output}, "
        f"aux_layer_ids={list(c.aux_layer_ids or [])}; report: {out}/serving_compatibility.md)"
    )
    return 0
