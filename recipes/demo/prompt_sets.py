"""Evaluation prompt sets from held-out stdlib files (JSONL, one ``{"id", "source", "prompt"}`` per line).

* ``standard``  : a held-out file from its start, cut after N lines (the model continues the code).
* ``long``      : the same, but at least 1,500 tokens of the file (prefill-heavy, long context).
* ``perturbed`` : the same code in a format unseen in training: a chat-style wrapper, tabs for
                  indentation, and an unusual header comment.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ...demo import PROMPT_SETS
from .corpus import SourceFile, read_text

SETS = PROMPT_SETS
LONG_MIN_TOKENS = 1500
HEADERS = (
    "# -*- coding: latin-1 -*-\n# vim: set ts=8 noet :\n# ~~~~ auto-exported snapshot, do not edit ~~~~\n",
    "#!/usr/bin/env python3\n# ==== REVIEW COPY (tabs) ==== build 4711 ====\n",
    "# %%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%\n"
    "# %  legacy module, kept verbatim  %\n"
    "# %%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%%\n",
)


def tabs_for_spaces(code: str) -> str:
    """Replace each leading group of 4 spaces by a tab.

    >>> tabs_for_spaces("def f():\\n        return 1\\n")
    'def f():\\n\\t\\treturn 1\\n'
    """
    out = []
    for line in code.splitlines(keepends=True):
        stripped = line.lstrip(" ")
        n = len(line) - len(stripped)
        out.append("\t" * (n // 4) + " " * (n % 4) + stripped)
    return "".join(out)


def chat_wrap(code: str, relpath: str, header: str) -> str:
    return f"<|user|>\nHere is the start of `{relpath}`. Please continue it.\n<|assistant|>\n```python\n{header}{code}"


def _cut_lines(text: str, n_lines: int) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[:n_lines])


def _count(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def make_prompts(root: Path, files: list[SourceFile], tok: Any, per_set: int, seed: int) -> dict[str, list[dict]]:
    """Build the three sets (``per_set`` prompts each when enough held-out text exists).

    Each held-out file gives several prompts, cut after different line counts; the cut points are
    drawn with ``random.Random(seed)``, so the sets are reproducible.
    """
    rng = random.Random(seed)
    texts = [(f, read_text(root, f)) for f in files]
    texts = [(f, t) for f, t in texts if t.count("\n") >= 20]
    if not texts:
        raise ValueError("no held-out file has 20 lines or more: cannot build prompt sets")
    sets: dict[str, list[dict]] = {name: [] for name in SETS}
    k = 0
    while any(len(v) < per_set for v in sets.values()) and k < 50 * per_set:
        f, text = texts[k % len(texts)]
        k += 1
        lines = text.splitlines(keepends=True)
        n = rng.randint(12, min(80, len(lines) - 5))
        short = _cut_lines(text, n)
        pid = f"{f.relpath}:{n}"
        if len(sets["standard"]) < per_set:
            sets["standard"].append({"id": pid, "source": f.relpath, "prompt": short})
        if len(sets["perturbed"]) < per_set:
            header = HEADERS[rng.randrange(len(HEADERS))]
            sets["perturbed"].append(
                {"id": pid, "source": f.relpath, "prompt": chat_wrap(tabs_for_spaces(short), f.relpath, header)}
            )
        if len(sets["long"]) < per_set and _count(tok, text) > LONG_MIN_TOKENS + 100:
            m = _lines_for_tokens(tok, lines, LONG_MIN_TOKENS + rng.randint(0, 300))
            if m < len(lines) - 2:
                sets["long"].append({"id": f"{f.relpath}:{m}", "source": f.relpath, "prompt": _cut_lines(text, m)})
    for name, v in sets.items():
        if len(v) < 50:
            raise ValueError(f"only {len(v)} prompts for the {name!r} set (need >= 50): hold out more files")
    return sets


def _lines_for_tokens(tok: Any, lines: list[str], min_tokens: int) -> int:
    """The smallest line count whose prefix has at least ``min_tokens`` tokens."""
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(tok, "".join(lines[:mid])) >= min_tokens:
            hi = mid
        else:
            lo = mid + 1
    return lo


def write_prompt_sets(root: Path, files: list[SourceFile], tok: Any, out: Path, per_set: int, seed: int) -> dict:
    """Write ``out/<set>.jsonl`` for every set; returns the prompt counts."""
    sets = make_prompts(root, files, tok, per_set, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in sets.items():
        with (out / f"{name}.jsonl").open("w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return {name: len(rows) for name, rows in sets.items()}
