"""``tritonspec export``: re-save a drafter as ``LlamaForCausalLMEagle3`` or speculators format."""

from __future__ import annotations

import argparse

from .common import add_command, parse_dtype


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers`` and return its parser."""
    e = add_command(
        subparsers,
        "export",
        "re-save a drafter as LlamaForCausalLMEagle3 or speculators format",
        """examples:
  tritonspec export --drafter ./yuhuili-eagle3 --out ./eagle3-sglang
  tritonspec export --drafter ./my-drafter --out ./my-drafter-spec --format speculators --dtype bfloat16""",
    )
    e.add_argument("--drafter", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--format", default="eagle3", choices=["eagle3", "speculators"])
    e.add_argument("--dtype", default=None)
    e.add_argument("--aux-layer-convention", default="auto", choices=["auto", "boundary", "post_layer"])
    e.set_defaults(fn=cmd_export)
    return e


def cmd_export(args: argparse.Namespace) -> int:
    import tritonspec as ts

    d = ts.Eagle3Drafter.from_pretrained(args.drafter, aux_layer_convention=args.aux_layer_convention)
    out = d.save_pretrained(args.out, format=args.format, dtype=parse_dtype(args.dtype))
    print(
        f"wrote {args.format} drafter to {out} (fc_norm={d.config.fc_norm}, norm_output={d.config.norm_output}, "
        f"aux_layer_ids={list(d.config.aux_layer_ids or [])})"
    )
    return 0
