"""Request handling on the host: prompts to token ids, seeds, stop ids, stop strings, outputs.

Nothing here touches a device tensor. ``encode_prompts`` validates and tokenizes a batch,
``row_seeds`` spreads the caller's seed over its rows, ``resolve_stop_ids`` resolves the stop ids,
``StopMatcher`` watches one row's text for stop strings incrementally, and ``RequestRows``
collects each row's emitted tokens and decides when a row is finished.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .errors import UserError
from .sampling import SamplingParams


def encode_prompts(
    prompts: Any, tokenizer: Any, *, vocab_size: int, max_seq_len: int, max_batch_size: int | None
) -> list[list[int]]:
    """Token id lists of ``prompts``, checked against the vocabulary, ``max_seq_len`` and
    ``max_batch_size`` (None: any number, as continuous batching takes them).

    Accepted, as transformers users pass them: a string, a list of strings, a token id list, a
    list of token id lists, a 1-D (one prompt) or 2-D (a batch) integer tensor or numpy array, or a
    list of 1-D ones. Token ids are Python, numpy or torch integers; floats, bools and bytes are
    refused (``UserError`` naming the value) rather than converted.

    Chat: one conversation (a list of ``{"role", "content"}`` dicts) or a list of conversations is
    rendered with the tokenizer's chat template and the generation prompt, exactly as
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` tokenizes it."""
    if is_conversation(prompts):
        prompts = [prompts]
    if _is_array(prompts):
        prompts = _array_prompts(prompts)
    elif isinstance(prompts, (bytes, bytearray)):
        raise UserError(f"prompts={prompts!r} is bytes: decode it to a string (prompts.decode()) or pass token ids")
    elif isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(_is_scalar(x) for x in prompts):
        prompts = [list(prompts)]  # one token id list (floats in it are refused below)
    if not isinstance(prompts, Sequence):
        raise UserError(f"prompts of type {type(prompts).__name__} are not accepted: {PROMPT_TYPES}")
    if len(prompts) == 0:
        raise UserError(f"prompts is empty: {PROMPT_TYPES}")
    chats = [_looks_like_chat(p) for p in prompts]
    if any(chats) and not all(chats):
        raise UserError(
            "a batch mixes chat conversations and raw prompts: chat rows stop at the end-of-turn token and "
            "raw ones do not, so send them in separate generate() calls"
        )
    batch: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise UserError(
                    "string prompts need a tokenizer: load a target directory that has one, "
                    "pass tokenizer=..., or pass token ids"
                )
            ids = list(tokenizer(p, add_special_tokens=True)["input_ids"])
        elif _looks_like_chat(p):
            ids = chat_ids(tokenizer, p, f"prompt {i}")
        else:
            ids = _token_ids(p, f"prompt {i}")
        if not ids:
            raise UserError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(ids) >= max_seq_len:
            raise UserError(
                f"prompt {i} has {len(ids)} tokens but max_seq_len={max_seq_len} "
                "(prompt + generated tokens); shorten it or raise max_seq_len"
            )
        batch.append(ids)
    if max_batch_size is not None and len(batch) > max_batch_size:
        raise UserError(
            f"{len(batch)} prompts exceed max_batch_size={max_batch_size}; split the batch or raise max_batch_size"
        )
    return batch


PROMPT_TYPES = (
    "pass a string, a list of strings, a token id list, a list of token id lists, "
    "a 1-D / 2-D integer tensor or numpy array, or chat messages (a list of "
    '{"role": ..., "content": ...} dicts, or a list of such conversations)'
)


def is_conversation(x: Any) -> bool:
    """One chat conversation: a non-empty list of dicts."""
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and bool(x) and isinstance(x[0], dict)


def is_chat(prompts: Any) -> bool:
    """``prompts`` is one conversation or a batch of them (``encode_prompts`` refuses mixed batches),
    so its rows stop at the template's end-of-turn token."""
    if is_conversation(prompts):
        return True
    batch = isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes))
    return batch and any(map(_looks_like_chat, prompts))


def _looks_like_chat(p: Any) -> bool:
    return isinstance(p, dict) or is_conversation(p)


def chat_ids(tokenizer: Any, messages: Any, what: str = "the conversation") -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template with the generation
    prompt (``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``).

    >>> chat_ids(None, [{"role": "user"}])
    Traceback (most recent call last):
    ...
    tritonspec.runtime.errors.UserError: the conversation, message 0: needs a "content" string ...
    """
    if isinstance(messages, dict):
        raise UserError(f"{what} is one message dict: wrap it in a list ([{{'role': ..., 'content': ...}}])")
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(
                f"{what}, message {j}: is a {type(m).__name__}; each message is a dict with 'role' and 'content'"
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise UserError(
                    f'{what}, message {j}: needs a "{key}" string (got {m.get(key)!r}); '
                    'messages look like {"role": "user", "content": "Hello"}'
                )
    if tokenizer is None:
        raise UserError("chat messages need a tokenizer with a chat template: load a target directory that has one")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the tokenizer has no chat template, so chat messages cannot be rendered; pass the text as a string"
        )
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception (jinja2 TemplateError), ValueError, ...
        raise UserError(f"{what}: the tokenizer's chat template cannot render it: {type(e).__name__}: {e}") from e
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


# special tokens chat templates end a turn with (ChatML, Llama 3, Gemma, Phi-3, Mistral)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Ids of the end-of-turn tokens the tokenizer's chat template writes (empty without one)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not isinstance(template, str):
        return set()
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab}


def _is_array(x: Any) -> bool:
    """A torch tensor or a numpy array (anything with ``ndim``, ``dtype`` and ``tolist``)."""
    return all(hasattr(x, a) for a in ("ndim", "dtype", "tolist")) and not isinstance(x, (str, bytes))


def _is_token(x: Any) -> bool:
    """A Python, numpy or torch (0-d) integer, not a bool."""
    if type(x) is int:  # the common case, fast
        return True
    if isinstance(x, bool) or (_is_array(x) and (x.ndim != 0 or _array_kind(x) != "int")):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _is_scalar(x: Any) -> bool:
    """A number (a token id, or a float that is not one): not a string, sequence or tensor row."""
    return isinstance(x, numbers.Number) or (_is_array(x) and x.ndim == 0)


def _array_kind(a: Any) -> str:
    """``"int"``, ``"bool"`` or ``"other"`` for a tensor's or an array's dtype."""
    d = a.dtype
    if isinstance(d, torch.dtype):
        if d == torch.bool:
            return "bool"
        return "other" if d.is_floating_point or d.is_complex else "int"
    kind = getattr(d, "kind", "")  # numpy: i / u integers, b bool
    return "int" if kind in ("i", "u") else "bool" if kind == "b" else "other"


def _array_prompts(a: Any) -> list:
    if _array_kind(a) != "int" or a.ndim not in (1, 2):
        raise UserError(
            f"a prompt tensor must be a 1-D (one prompt) or 2-D (a batch) integer tensor, "
            f"got {a.ndim}-D with dtype {a.dtype}"
        )
    return [a.tolist()] if a.ndim == 1 else a.tolist()


def _token_ids(p: Any, what: str) -> list[int]:
    """``p`` (a sequence of integers, or a 1-D integer tensor/array) as a list of ints."""
    if _is_array(p):
        if _array_kind(p) != "int" or p.ndim != 1:
            raise UserError(f"{what} must be a 1-D integer tensor, got {p.ndim}-D with dtype {p.dtype}")
        return p.tolist()
    if isinstance(p, (bytes, bytearray)) or not isinstance(p, Sequence):
        raise UserError(f"{what} is {p!r}: {PROMPT_TYPES}")
    bad = [t for t in p if not _is_token(t)]
    if bad:
        raise UserError(f"{what} has token ids that are not integers: {bad[:5]!r}")
    return [operator.index(t) for t in p]


def as_int(value: Any, name: str) -> int:
    """``value`` as an int when it is a Python, numpy or torch integer (not a bool), else a
    ``UserError`` naming it."""
    if not _is_token(value):
        raise UserError(f"{name}={value!r} must be an integer")
    return operator.index(value)


def as_float(value: Any, name: str) -> float:
    """``value`` as a float when it is a real number (Python, numpy or a 0-d tensor; not a bool or
    a string), else a ``UserError`` naming it."""
    if isinstance(value, (bool, str, bytes)) or (_is_array(value) and value.ndim != 0):
        raise UserError(f"{name}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name}={value!r} must be a number") from None


def one_prompt(prompt: Any) -> list:
    """``prompt`` (one string, token id list or 1-D tensor/array) as a batch of one for
    ``encode_prompts``; a batch is a ``UserError`` (``stream`` decodes one prompt)."""
    one = isinstance(prompt, (str, bytes, bytearray)) or (_is_array(prompt) and prompt.ndim == 1)
    if is_conversation(prompt) and all(isinstance(m, dict) for m in prompt):
        return [prompt]
    if one or (isinstance(prompt, Sequence) and all(_is_token(t) for t in prompt)):
        return [prompt]
    raise UserError(
        "stream() takes one prompt (a string, a token id list, a 1-D integer tensor or one conversation); "
        "use generate() for batches"
    )


def row_seeds(seed: Any, batch: int, sampling: SamplingParams) -> list[int]:
    """One seed per row: ``seed`` for every row, one per row, or random ones (greedy: zeros).
    A seed is a Python, numpy or torch integer; a sequence (or 1-D tensor) gives one per row."""
    if seed is None:
        return torch.randint(0, 2**62, (batch,)).tolist() if not sampling.greedy else [0] * batch
    if _is_token(seed):
        return [operator.index(seed)] * batch
    if _is_array(seed) and seed.ndim == 1 and _array_kind(seed) == "int":
        seed = seed.tolist()
    if isinstance(seed, (str, bytes, bytearray)) or not isinstance(seed, Sequence):
        raise UserError(f"seed={seed!r}: pass one integer, or one integer per prompt")
    seeds = [as_int(s, "seed") for s in seed]
    if len(seeds) != batch:
        raise UserError(f"{len(seeds)} seeds for {batch} prompts: pass one int or one seed per prompt")
    return seeds


def row_budgets(max_new_tokens: Any, batch: int) -> list[int]:
    """One ``max_new_tokens`` per row: one integer for every row, or one per row (vLLM's per-request
    ``max_tokens``); each at least 1. A sequence (or 1-D integer array) gives one per row."""
    if _is_array(max_new_tokens) and max_new_tokens.ndim == 1 and _array_kind(max_new_tokens) == "int":
        max_new_tokens = max_new_tokens.tolist()
    if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes, bytearray)):
        budgets = [as_int(n, "max_new_tokens") for n in max_new_tokens]
        if len(budgets) != batch:
            raise UserError(
                f"{len(budgets)} max_new_tokens values for {batch} prompts: pass one int or one value per prompt"
            )
        where = " (prompt {})"
    else:
        budgets, where = [as_int(max_new_tokens, "max_new_tokens")] * batch, ""
    for b, n in enumerate(budgets):
        if n < 1:
            raise UserError(f"max_new_tokens={n}{where.format(b)} must be >= 1")
    return budgets


def resolve_stop_ids(
    stop_ids: Any, tokenizer: Any, config: Any, vocab_size: int | None = None, chat: bool = False
) -> set[int]:
    """The caller's stop ids (integers in ``[0, vocab_size)``), else the tokenizer's EOS, else the
    model config's (none: empty); for chat prompts also the template's end-of-turn token."""
    if stop_ids is not None:
        if _is_token(stop_ids):
            raise UserError(f"stop_token_ids={stop_ids!r}: pass a list of token ids, e.g. [{stop_ids!r}]")
        if _is_array(stop_ids):
            stop_ids = stop_ids.tolist() if stop_ids.ndim == 1 and _array_kind(stop_ids) == "int" else [stop_ids]
        if isinstance(stop_ids, (str, bytes, bytearray)) or not isinstance(stop_ids, Iterable):
            raise UserError(f"stop_token_ids={stop_ids!r} must be a list of integer token ids")
        ids = list(stop_ids)
        bad = [t for t in ids if not _is_token(t)]
        if bad:
            raise UserError(f"stop_token_ids has values that are not integer token ids: {bad[:5]!r}")
        ids = [operator.index(t) for t in ids]
        if vocab_size is not None:
            out = [t for t in ids if not 0 <= t < vocab_size]
            if out:
                raise UserError(f"stop_token_ids {out[:5]} lie outside the vocabulary [0, {vocab_size})")
        return set(ids)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    return ids | end_of_turn_ids(tokenizer) if chat else ids


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
    strings, ``max_new_tokens`` (one for every row, or one per row) and ``max_seq_len`` (tokens decided
    past a stop are dropped), and returns the rows that finished in this call.
    """

    def __init__(
        self,
        prompt_lens: list[int],
        *,
        max_new_tokens: int | list[int],
        max_seq_len: int,
        stop_ids: set[int],
        sampling: SamplingParams,
        tokenizer: Any,
    ):
        n = len(prompt_lens)
        self.prompt_lens = prompt_lens
        self.max_new_tokens = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(self.max_new_tokens) != n:
            raise ValueError(f"{len(self.max_new_tokens)} max_new_tokens for {n} rows")
        self.max_seq_len = max_seq_len
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
                if len(out) >= self.max_new_tokens[b] or self.prompt_lens[b] + len(out) >= self.max_seq_len:
                    self.done[b] = True
                    break
            if self.done[b]:
                finished.append(b)
        return finished

    def text(self, b: int) -> str:
        """Row ``b``'s text, cut before the first stop string."""
        return cut_at_stop(decode(self.tokenizer, self.outs[b]), self.sampling.stop)
