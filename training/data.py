"""Training data for drafters: loading, validation, self-distillation, and the draft vocabulary.

Accepted data (``load_token_sequences``):

* a ``.jsonl`` file whose records hold ``"text"`` (tokenized with the target's tokenizer) or
  ``"input_ids"`` (already tokenized; checked against the target vocabulary);
* a ``.txt`` / ``.py`` file or a folder of ``*.py`` files (each file one document);
* a Python list of strings or of token-id lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def load_token_sequences(data: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token-id sequences from ``data`` (see module docstring); raises on empty or bad input.

    >>> load_token_sequences([[1, 2, 3]], None, 10)
    [[1, 2, 3]]
    """
    docs = list(_iter_documents(data))
    if not docs:
        raise ValueError(f"training data {_describe(data)} is empty: give at least one non-empty text or id list")
    seqs: list[list[int]] = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError(
                    "text data needs a tokenizer: the target directory has none; pass tokenizer=... "
                    "or pre-tokenized input_ids"
                )
            ids = list(tokenizer(doc, add_special_tokens=False)["input_ids"])
            eos = getattr(tokenizer, "eos_token_id", None)
            if ids and eos is not None:
                ids.append(int(eos))
        else:
            ids = [int(t) for t in doc]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"document {i} of {_describe(data)} has token ids outside the target vocabulary "
                f"[0, {vocab_size}): {bad[:5]}; was it tokenized with another tokenizer?"
            )
        if ids:
            seqs.append(ids)
    if sum(len(s) for s in seqs) < 2:
        raise ValueError(
            f"training data {_describe(data)} tokenizes to fewer than 2 tokens: nothing to learn from "
            "(is it untokenisable, or all blank?)"
        )
    return seqs


def _describe(data: Any) -> str:
    return repr(str(data)) if isinstance(data, (str, Path)) else f"({type(data).__name__})"


def _iter_documents(data: Any) -> Iterable[str | Sequence[int]]:
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.exists():
            raise FileNotFoundError(f"training data {path} does not exist")
        if path.is_dir():
            files = sorted(path.rglob("*.py"))
            if not files:
                raise ValueError(f"training data folder {path} holds no *.py files")
            for f in files:
                yield _read_text(f)
        elif path.suffix == ".jsonl":
            yield from _iter_jsonl(path)
        else:
            yield _read_text(path)
        return
    if isinstance(data, Sequence):
        for i, item in enumerate(data):
            ids_like = isinstance(item, Sequence) and all(isinstance(t, (int, np.integer)) for t in item)
            if isinstance(item, str) or ids_like:
                yield item
            elif isinstance(item, torch.Tensor) and not item.is_floating_point():
                yield item.tolist()
            else:
                raise ValueError(f"training data item {i} is a {type(item).__name__}: give strings or token-id lists")
        return
    raise TypeError(f"training data must be a path or a list of strings / token-id lists, got {type(data).__name__}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"training data {path} is not UTF-8 text ({e}); convert it or pass token ids") from e


def _iter_jsonl(path: Path) -> Iterable[str | list[int]]:
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            if isinstance(rec, dict) and "input_ids" in rec:
                yield rec["input_ids"]
            elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
                yield rec["text"]
            else:
                raise ValueError(f"{path}:{n}: a record needs a 'text' string or an 'input_ids' list")


def check_tokenizer(tokenizer: Any, target_config: Any, target_tokenizer: Any = None) -> None:
    """Fail when a tokenizer cannot belong to the target (vocabulary too large, or different from the
    tokenizer shipped with the target)."""
    n = len(tokenizer)
    if n > target_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {n} tokens but the target's vocab_size is {target_config.vocab_size}: "
            "it does not match the target; use the tokenizer saved with the target"
        )
    if target_tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            "the tokenizer differs from the one saved in the target directory; use the target's "
            "tokenizer (or omit tokenizer=...)"
        )


def token_windows(seqs: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate the sequences and cut non-overlapping windows ``[N, seq_len]`` (the tail is dropped,
    or kept shorter data as one padded-free window when there is less than one window)."""
    stream = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    if stream.numel() < seq_len:
        return stream[None, :]
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def draft_vocab_from_counts(seqs: list[list[int]], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent target ids (ties to the lower id), sorted (§2.5).

    Padded with the lowest unused ids when fewer distinct ids occur (as SpecForge does).

    >>> draft_vocab_from_counts([[5, 5, 2]], 8, 3).tolist()
    [0, 2, 5]
    """
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} is larger than the target vocabulary ({vocab_size}); "
            f"use at most {vocab_size}"
        )
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s, dtype=torch.int64), minlength=vocab_size)
    # stable sort on -count keeps lower ids first among ties; unseen ids (count 0) pad in id order
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


def regenerate_continuations(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    out: Path | str,
    *,
    device: Any = "cpu",
    batch_size: int = 8,
    log: Callable[[str], None] = print,
) -> Path:
    """Self-distillation data: greedy continuations by the target itself, written as JSONL records
    ``{"input_ids": prompt + continuation, "prompt_len": n}``.

    ``target``: a model directory, or an already loaded ``TargetModel`` (used as it is: no second
    copy). Runs plain decoding through ``SpeculativeRuntime(speculative=False)``.
    """
    from ..runtime.engine import SpeculativeRuntime
    from ..runtime.target import TargetModel

    if not prompts:
        raise ValueError("no prompts to regenerate from")
    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    kw = dict(max_batch_size=batch_size, max_seq_len=longest, backend="torch")
    if isinstance(target, TargetModel):
        rt = SpeculativeRuntime(target, None, **kw)
    else:
        rt = SpeculativeRuntime.from_pretrained(target, None, device=device, **kw)
    out = Path(out)
    tmp = out.with_suffix(".partial")
    with tmp.open("w") as fh:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            gen = rt.generate(chunk, max_new_tokens=max_new_tokens, speculative=False, stop_token_ids=[])
            for p, new in zip(chunk, gen.token_ids):
                fh.write(json.dumps({"input_ids": list(p) + list(new), "prompt_len": len(p)}) + "\n")
            log(
                f"regenerate: {min(i + batch_size, len(prompts))}/{len(prompts)} continuations "
                f"({gen.stats.tokens_per_second:.0f} tokens/s)"
            )
    tmp.replace(out)
    return out
