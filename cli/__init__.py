"""Command line: ``tritonspec <command>`` (also ``python -m tritonspec``).

The top layer: it imports the library (runtime, autotune, training, demo), never the reverse.
One module per command, each with ``add_parser(subparsers)`` and its ``cmd_*`` function:

* ``generate`` (``cli/generate.py``): one prompt, speculative or plain; tokens/s, acceptance, speedup
* ``export`` (``cli/export.py``): re-save a drafter as LlamaForCausalLMEagle3 or speculators format
* ``bench`` (``cli/bench.py``): side-by-side throughput table, ours vs transformers
* ``drift`` (``cli/drift.py``): attention drift per draft depth, JSON + PNG plots
* ``train`` (``cli/train.py``): train an EAGLE-3 / EAGLE-3.1 drafter
* ``autotune kernels|tree`` (``cli/autotune.py``): kernel launch configs, draft-tree shape
* ``audit`` (``cli/audit.py``): deterministic mode certified on a prompt set, Markdown + JSON report

``cli/common.py`` holds what they share (the subcommand parser, demo / tiny-random targets,
``--dtype``, tree-shape flags, prompts). Library imports stay inside the command functions, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from ..runtime.errors import UserError
from . import audit, autotune, bench, drift, export, generate, train

COMMANDS = (generate, export, bench, drift, train, autotune, audit)  # the order ``tritonspec --help`` lists them in

# What a command reports as a one-line error (exit status 2): mistakes in the user's input
# (``UserError``, the library's family for them, is a ValueError) and file-system refusals (a missing
# file, a file where a directory belongs, no permission). Anything else (TypeError, KeyError, ...)
# is a bug and keeps its traceback.
USER_ERRORS = (
    UserError,
    ValueError,
    NotImplementedError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``tritonspec`` parser with every subcommand; ``args.fn(args)`` runs the chosen one."""
    p = argparse.ArgumentParser(prog="tritonspec", description="EAGLE-3/3.1 speculative decoding with Triton hot paths")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``tritonspec`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"tritonspec {args.command}: error: {e}", file=sys.stderr)
        return 2


__all__ = ["main", "build_parser"]
