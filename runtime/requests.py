"""Request handling on the host: prompts to token ids, seeds, stop ids, stop strings, outputs.

Nothing here touches a device tensor. ``encode_prompts`` validates and tokenizes a batch,
``row_seeds`` spreads the caller's seed over its rows, ``resolve_stop_ids`` resolves the stop ids,
``StopMatcher`` watches one row's text for stop strings incrementally, and ``RequestRows``
collects each row's emitted tokens and decides when a row is finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .sampling import SamplingParams


def encode_prompts(
    prompts: Any, tokenizer: Any, *, vocab_size: int, max_seq_len: int, max_batch_size: int
) -> list[list[int]]:
    """Token id lists of ``prompts`` (a string, a list of strings, a token id list or a list of
    them), checked against the vocabulary, ``max_seq_len`` and ``max_batch_size``."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(x, int) for x in prompts):
        prompts = [list(prompts)]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts is empty: pass a string, a list of strings, or token id lists")
    batch: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(
                    "string prompts need a tokenizer: load a target directory that has one, "
                    "pass tokenizer=..., or pass token ids"
                )
            ids = list(tokenizer(p, add_special_tokens=True)["input_ids"])
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(ids) >= max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens but max_seq_len={max_seq_len} "
                "(prompt + generated tokens); shorten it or raise max_seq_len"
            )
        batch.append(ids)
    if len(batch) > max_batch_size:
        raise ValueError(
            f"{len(batch)} prompts exceed max_batch_size={max_batch_size}; split the batch or raise max_batch_size"
        )
    return batch


def row_seeds(seed: int | Sequence[int] | None, batch: int, sampling: SamplingParams) -> list[int]:
    """One seed per row: ``seed`` for every row, one per row, or random ones (greedy: zeros)."""
    if seed is None:
        return torch.randint(0, 2**62, (batch,)).tolist() if not sampling.greedy else [0] * batch
    if isinstance(seed, int):
        return [seed] * batch
    seeds = [int(s) for s in seed]
    if len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for {batch} prompts: pass one int or one seed per prompt")
    return seeds


def resolve_stop_ids(stop_ids: Iterable[int] | None, tokenizer: Any, config: Any) -> set[int]:
    """The caller's stop ids, else the tokenizer's EOS, else the model config's (none: empty)."""
    if stop_ids is not None:
        return {int(t) for t in stop_ids}
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def decode(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first stop string (all of it when none occurs)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class StopMatcher:
    """Watches one row's decoded text for stop strings, token by token, in linear time.

    ``push(t)`` answers whether ``decode(tokens so far)`` contains a stop string, as re-decoding
    the whole output would, but decodes only a short tail (the incremental detokenizer of vLLM
    and TGI): ``text`` holds the decoded text of ``tokens[:read]``, and each push decodes
    ``tokens[prefix:]`` against ``tokens[prefix:read]``, so a multi-byte character split across
    tokens (shown as U+FFFD until complete) and tokenizers whose first token decodes differently
    both come out as in the full decode. The search covers only the text a new stop could end in.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.longest = max(len(s) for s in self.stops)
        self.tokens: list[int] = []
        self.text = ""  # decoded text of tokens[:read]
        self.prefix = self.read = 0
        self.searched = 0  # characters of the full text already searched

    def push(self, token: int) -> bool:
        self.tokens.append(int(token))
        head = decode(self.tokenizer, self.tokens[self.prefix : self.read])
        tail = decode(self.tokenizer, self.tokens[self.prefix :])
        base = len(self.text) - len(head)  # the full text is text[:base] + tail
        lo = max(0, min(self.searched, base) - self.longest + 1)
        window = (self.text[lo:base] + tail) if lo < base else tail[lo - base :]
        self.searched = base + len(tail)
        if len(tail) > len(head) and not tail.endswith("\ufffd"):  # complete characters: move on
            self.text = self.text[:base] + tail
            self.prefix, self.read = self.read, len(self.tokens)
        return any(s in window for s in self.stops)


class RequestRows:
    """The host side of a batch: each prompt's emitted tokens, finish reason and stop handling.

    ``emit(new)`` appends each unfinished row's new tokens, honouring stop token ids, stop
    strings, ``max_new_tokens`` and ``max_seq_len`` (tokens decided past a stop are dropped), and
    returns the rows that finished in this call.
    """

    def __init__(
        self,
        prompt_lens: list[int],
        *,
        max_new_tokens: int,
        max_seq_len: int,
        stop_ids: set[int],
        sampling: SamplingParams,
        tokenizer: Any,
    ):
        n = len(prompt_lens)
        self.prompt_lens = prompt_lens
        self.max_new_tokens, self.max_seq_len = max_new_tokens, max_seq_len
        self.stop_ids = stop_ids
        self.sampling, self.tokenizer = sampling, tokenizer
        self.outs: list[list[int]] = [[] for _ in range(n)]
        self.reasons = ["length"] * n
        self.done = [False] * n
        self.matchers = [StopMatcher(tokenizer, sampling.stop) for _ in range(n)] if sampling.stop else None

    def emit(self, new: list[list[int]]) -> list[int]:
        finished = []
        for b, toks in enumerate(new[: len(self.outs)]):
            if self.done[b]:
                continue
            out = self.outs[b]
            for t in toks:
                out.append(t)
                if t in self.stop_ids or (self.matchers is not None and self.matchers[b].push(t)):
                    self.reasons[b] = "stop"
                    self.done[b] = True
                    break
                if len(out) >= self.max_new_tokens or self.prompt_lens[b] + len(out) >= self.max_seq_len:
                    self.done[b] = True
                    break
            if self.done[b]:
                finished.append(b)
        return finished

    def text(self, b: int) -> str:
        """Row ``b``'s text, cut before the first stop string."""
        return cut_at_stop(decode(self.tokenizer, self.outs[b]), self.sampling.stop)
