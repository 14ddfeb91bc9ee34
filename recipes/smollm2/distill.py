"""Self-distillation: SmolLM2 answers the recipe's instructions itself (greedy and sampled).

Writes JSONL records ``{"id", "kind", "sampled", "input_ids", "prompt_len"}`` (the prompt in the
chat template with the generation prompt, then the answer up to and including ``<|im_end|>``),
appending as batches finish, so a stopped run resumes where it left off.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = {"complete": 160, "write": 256, "explain": 256, "fix": 256, "general": 256}


def encode(tokenizer: Any, prompt: str | list[dict]) -> list[int]:
    """Token ids of a raw string, or of chat messages with the generation prompt appended."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def distill(
    runtime: Any,
    records: list[dict],
    out: Path,
    *,
    batch_size: int = 32,
    sampled_every: int = 3,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Answer every record (every ``sampled_every``-th sampled at temperature 1, seeded by its index)
    until ``deadline`` (``time.time()`` value); returns ``out``."""
    out = Path(out)
    done = set()
    if out.exists():
        lines = out.read_text().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):  # a run stopped mid-write: drop the torn record
            lines = lines[:-1]
            out.write_text("".join(lines))
        done = {json.loads(line)["id"] for line in lines if line.strip()}
    todo = [(i, r) for i, r in enumerate(records) if r["id"] not in done]
    tok = runtime.tokenizer
    # group by kind and mode so a batch shares its length cap and sampling mode
    groups: dict[tuple[str, bool], list] = {}
    for i, r in todo:
        groups.setdefault((r["kind"], i % sampled_every == 0), []).append((i, r))
    # within a group, prompts by length, so a batch's rows pad to similar lengths (a batch prefills
    # every row to its longest prompt: mixed lengths spent 2.5x the rows); batches taken
    # round-robin over the groups, so a run cut by its deadline has every kind
    ids = {r["id"]: encode(tok, r["prompt"]) for _, r in todo}
    batches = []
    for key, items in sorted(groups.items()):
        items = sorted(items, key=lambda ir: (len(ids[ir[1]["id"]]), ir[0]))
        batches.append([(key, items[b : b + batch_size]) for b in range(0, len(items), batch_size)])
    order = [q[j] for j in range(max(map(len, batches), default=0)) for q in batches if j < len(q)]
    t0, n_tok = time.time(), 0
    with out.open("a") as fh:
        for n_batch, ((kind, sampled), chunk) in enumerate(order):
            if deadline is not None and time.time() > deadline:
                log(f"distill: time budget reached with {n_tok} new tokens; rerun to continue")
                return out
            prompts = [ids[r["id"]] for _, r in chunk]
            gen = runtime.generate(
                prompts,
                max_new_tokens=MAX_NEW_TOKENS[kind],
                speculative=False,
                temperature=1.0 if sampled else 0.0,
                seed=[i for i, _ in chunk],
            )
            for (_, r), p, new in zip(chunk, prompts, gen.token_ids):
                rec = {"id": r["id"], "kind": kind, "sampled": sampled, "prompt_len": len(p)}
                rec["input_ids"] = p + list(new)
                fh.write(json.dumps(rec) + "\n")
                n_tok += len(new)
            fh.flush()
            log(
                f"distill: batch {n_batch + 1}/{len(order)} ({kind}, sampled={sampled}); "
                f"{n_tok} tokens in {time.time() - t0:.0f} s"
            )
    return out
