"""Helpers shared by the commands: the subcommand parser (``add_command``), flags passed on under
their own names, target names (demo, tiny random pair), dtype flags, tree-shape flags and prompt
reading. Light at import time: torch and the runtime load inside the functions."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from ..runtime.errors import UserError
from ..runtime.gguf import KNOWN_MODELS

TINY = "tiny-random"
DEMO = "demo"  # the bundled demo pair (tritonspec.demo); "demo:eagle3" picks the EAGLE-3 drafter


def add_command(subparsers, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` to ``subparsers`` with its one-line ``help`` and an ``epilog``
    (examples, notes) printed as written; return its parser."""
    return subparsers.add_parser(name, help=help, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)


def flag_values(args: argparse.Namespace, names: str) -> dict:
    """``{name: args.<name>}`` for the space-separated ``names``: flags passed on under their own names."""
    return {name: getattr(args, name) for name in names.split()}


def spec_from_flags(
    depth: int | None, top_k: int | None, n: int | None, lookup: int | None = None, lookup_min: int | None = None
):
    """None when no shape flag is given (a tuned profile, else the defaults); else the defaults with
    the given flags, a default ``num_draft_tokens`` capped at what the shape can draft (so
    ``--draft-top-k 1`` alone is a chain). A given 0 is passed on (and refused), never a default.
    ``lookup``: ``--prompt-lookup-num-tokens`` (a shape flag like the others); ``lookup_min``:
    ``--prompt-lookup-min``, the shortest suffix a branch matches (needs ``lookup``)."""
    from ..runtime.config import SpecConfig

    if lookup_min is not None and not lookup:
        raise UserError(f"--prompt-lookup-min {lookup_min} needs a lookup branch: add --prompt-lookup-num-tokens 4")
    if (depth, top_k, n, lookup) == (None, None, None, None):
        return None
    d = SpecConfig()
    depth = d.num_speculative_tokens if depth is None else depth
    top_k = d.top_k if top_k is None else top_k
    if min(depth, top_k) < 1:
        SpecConfig(depth, top_k, 2)  # raises the UserError naming the flag's value
    if n is None:
        n = min(d.num_draft_tokens, top_k + (depth - 1) * top_k * top_k + 1)
    extra = {} if lookup_min is None else {"prompt_lookup_min": lookup_min}
    return SpecConfig(depth, top_k, n, prompt_lookup_num_tokens=lookup or 0, **extra)


def cache_dir() -> Path:
    """Where generated artefacts (the tiny random pair) live: ``$TRITONSPEC_CACHE`` or ~/.cache/tritonspec."""
    return Path(os.environ.get("TRITONSPEC_CACHE", Path.home() / ".cache" / "tritonspec"))


def is_demo(target: str) -> bool:
    """True for ``demo``, ``demo:eagle3`` and ``demo:eagle3.1``."""
    return target in (DEMO, f"{DEMO}:eagle3", f"{DEMO}:eagle3.1")


def resolve_pair(target: str, drafter: str | None) -> tuple[str, str | None]:
    """``(target_dir, drafter_dir)`` for a ``--target`` / ``--drafter`` pair: the demo pair, the
    tiny random pair and known GGUF models (``smollm2``, ``smollm2:eagle3``, ``smollm2:plain``;
    their shipped drafter unless ``--drafter``) are resolved to their directories (``--drafter``
    still wins); anything else (a directory, a ``.gguf`` file) is passed through."""
    if is_demo(target):
        from ..demo import demo_pair

        tdir, ddir = demo_pair(target.partition(":")[2] or "eagle3.1")
        return str(tdir), (drafter or str(ddir))
    name, _, variant = target.partition(":")
    if name.lower() in KNOWN_MODELS:
        from ..drafters import shipped_drafter
        from ..runtime.gguf import resolve_target

        tdir = resolve_target(name.lower())
        if drafter is None and variant != "plain":
            drafter = shipped_drafter(name.lower(), variant or "eagle3.1")
        return str(tdir), (str(drafter) if drafter is not None else None)
    if target != TINY:
        return target, drafter
    from ..runtime.tiny import tiny_random_pair

    tdir, ddir = tiny_random_pair(cache_dir() / TINY)
    print(
        f"note: '{TINY}' is a random-weight Llama target and drafter ({tdir.parent}); the text is noise and "
        "the drafter is accepted only by chance",
        file=sys.stderr,
    )
    return str(tdir), (drafter or str(ddir))


def default_target() -> str:
    """The demo pair when its weights are installed, else the tiny random pair."""
    from ..demo import available

    return DEMO if available() else TINY


def parse_dtype(name: str | None):
    """A ``--dtype`` value as a torch dtype (None stays None); an unknown name exits with a message."""
    import torch

    if name is None:
        return None
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise UserError(f"--dtype {name!r}: use one of {', '.join(table)}")
    return table[name]


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or stdin when it is missing or ``-``; an empty prompt exits with a message."""
    prompt = arg
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise UserError("empty prompt: pass it as an argument or on stdin")
    return prompt


_ESCAPE = re.compile(r"\\(?:([\\nrt0'\"])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4}))")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def unescape(text: str) -> str:
    """Decode the backslash escapes a shell passes through literally (``--stop "\\n\\n"`` is
    backslash, n, backslash, n): ``\\n \\r \\t \\0 \\\\ \\' \\" \\xHH \\uXXXX``; other text,
    non-ASCII included, is kept as is."""

    def one(m: re.Match) -> str:
        simple, hex2, hex4 = m.groups()
        return _SIMPLE[simple] if simple else chr(int(hex2 or hex4, 16))

    return _ESCAPE.sub(one, text)


def demo_prompts(name: str) -> list[str]:
    """The prompt strings of a bundled demo prompt set (standard, long, perturbed)."""
    from ..demo import prompt_set

    return [r["prompt"] for r in prompt_set(name)]
