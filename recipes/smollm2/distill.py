"""Self-distillation: SmolLM2 answers the recipe's instructions itself (greedy and sampled).

Writes JSONL records ``{"id", "kind", "sampled", "input_ids", "prompt_len"}`` (the prompt in the
chat template with the generation prompt, then the answer up to and including ``<|im_end|>``),
appending as batches finish, so a stopped run resumes where it left off.

``self_chat_queries`` also lets SmolLM2 write the questions: given only the chat template up to a
user turn (its default system message, then ``<|im_start|>user``), an instruction-tuned model
samples what a user would ask (the "Magpie" method, Xu et al. 2024, arXiv:2406.08464): everyday
chat requests of every kind, where the stdlib-derived instructions are mostly code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = {
    "complete": 160,
    "write": 256,
    "explain": 256,
    "fix": 256,
    "general": 256,
    "chat": 256,
    "long": 256,
    "task": 256,
}
BATCH_DIVISOR = {"long": 4}  # long-context prompts (~2K tokens) go in batches of batch_size // 4
QUERY_MAX_TOKENS = 48  # a sampled user question longer than this is dropped (truncated ones ramble)


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
    until ``deadline`` (``time.time()`` value), ``batch_size`` prompts a batch (a kind in
    ``BATCH_DIVISOR``, e.g. ``long``, that many times fewer); returns ``out``."""
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
        n = max(1, batch_size // BATCH_DIVISOR.get(key[0], 1))
        batches.append([(key, items[b : b + n]) for b in range(0, len(items), n)])
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


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts (with the
    template's default system message, as every chat prompt gets)."""
    mark = "\x00USER\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], add_generation_prompt=False, tokenize=False
    )
    if mark not in text:
        raise ValueError("the tokenizer's chat template does not place the user message's text verbatim")
    return list(tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"])


def keep_query(text: str, seen: set[str]) -> str | None:
    """A sampled question, cleaned, or None to drop it: too short (< 3 words) or long (> 400
    characters), template markup, or a repeat (case- and space-insensitive) of one in ``seen``."""
    q = text.strip()
    key = " ".join(q.lower().split())
    if len(q.split()) < 3 or len(q) > 400 or "<|" in q or key in seen:
        return None
    seen.add(key)
    return q


def self_chat_records(out: Path, n: int, seed: int) -> tuple[list[dict], int, set[str]]:
    """The first ``n`` kept questions of ``self_chat_queries``' file ``out`` as recipe records
    ``{"id": "selfchat.<seed>.<attempt>", "kind": "chat", "prompt": [user message]}``, the next
    attempt number and the questions seen (for the filter)."""
    done: list[dict] = []
    out = Path(out)
    if out.exists():
        lines = out.read_text().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):  # a torn last record
            lines = lines[:-1]
            out.write_text("".join(lines))
        done = [json.loads(line) for line in lines if line.strip()]
    seen: set[str] = set()
    kept = [(d["attempt"], q) for d in done if d["query"] and (q := keep_query(d["query"], seen))]
    recs = [
        {"id": f"selfchat.{seed}.{a}", "kind": "chat", "prompt": [{"role": "user", "content": q}]} for a, q in kept[:n]
    ]
    return recs, 1 + max((d["attempt"] for d in done), default=-1), seen


def self_chat_queries(
    runtime: Any,
    n: int,
    out: Path,
    *,
    batch_size: int = 32,
    seed: int = 0,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """``n`` user questions SmolLM2 writes itself (module docstring), as ``self_chat_records``.

    Each attempt samples at temperature 1 (seed ``seed * 10**6 + attempt``) from the user-turn
    prefix until end of turn, at most ``QUERY_MAX_TOKENS`` tokens; ``keep_query`` filters. Every
    attempt is appended to ``out`` (``{"attempt", "query"}``, ``query`` None when dropped), so a
    stopped run resumes with the next seeds and the same questions; stops at ``deadline``."""
    tok = runtime.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tok.unk_token_id:
        raise ValueError("self-chat questions need an <|im_end|> end-of-turn token (a ChatML template)")
    prefix = user_turn_prefix(tok)
    recs, attempt, seen = self_chat_records(out, n, seed)
    kept = len(recs)
    t0 = time.time()
    with Path(out).open("a") as fh:
        while kept < n:
            if deadline is not None and time.time() > deadline:
                log(f"self-chat: time budget reached with {kept} questions; rerun to continue")
                break
            gen = runtime.generate(
                [prefix] * batch_size,
                max_new_tokens=QUERY_MAX_TOKENS,
                speculative=False,
                temperature=1.0,
                seed=[seed * 10**6 + attempt + j for j in range(batch_size)],
                stop_token_ids=[end],
            )
            for j, new in enumerate(gen.token_ids):
                new = list(new)
                q = keep_query(tok.decode(new[:-1]), seen) if new and new[-1] == end else None
                fh.write(json.dumps({"attempt": attempt + j, "query": q}) + "\n")
                kept += q is not None
            fh.flush()
            attempt += batch_size
            log(f"self-chat: {kept}/{n} questions from {attempt} samples in {time.time() - t0:.0f} s")
    return self_chat_records(out, n, seed)[0]
