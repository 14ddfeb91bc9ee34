"""Host-side request handling (runtime/requests.py): the incremental stop-string matcher agrees
with searching the whole decoded output, in linear time; prompt encoding and seeds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.runtime.requests import StopMatcher, cut_at_stop, encode_prompts, row_seeds
from tritonspec.runtime.sampling import SamplingParams
from tritonspec.runtime.tiny import byte_tokenizer

_TOK = {}


def _byte_tok(tmp_path_factory):
    if "byte" not in _TOK:
        _TOK["byte"] = byte_tokenizer(tmp_path_factory.mktemp("bytetok"))
    return _TOK["byte"]


def _demo_tok():
    if "demo" not in _TOK:
        from transformers import AutoTokenizer

        _TOK["demo"] = AutoTokenizer.from_pretrained(str(ts.demo_pair()[0]))
    return _TOK["demo"]


def _first_hit_full(tok, ids, stops):
    """The quadratic rule the matcher replaces: decode the whole output after every token."""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1], skip_special_tokens=True)
        if any(s in text for s in stops):
            return i
    return None


def _first_hit(tok, ids, stops):
    m = StopMatcher(tok, stops)
    return next((i for i, t in enumerate(ids) if m.push(t)), None)


# bytes of multi-byte characters, ASCII, and stray continuation bytes (invalid UTF-8)
_BYTES = st.lists(
    st.sampled_from([0x61, 0x62, 0x20, 0x0A, 0xE2, 0x82, 0xAC, 0xC3, 0xA9, 0x80]), min_size=1, max_size=40
)
_STOPS = st.lists(
    st.sampled_from(["a", "ab", "b ", "\n\n", "€", "é", "a€", "\ufffd", " \n", "bab"]), min_size=1, max_size=3
)


@settings(max_examples=300, deadline=None)
@given(data=_BYTES, stops=_STOPS)
def test_matcher_equals_full_decode_on_bytes(tmp_path_factory, data, stops):
    tok = _byte_tok(tmp_path_factory)
    ids = [_byte_id(tok, b) for b in data]
    assert _first_hit(tok, ids, stops) == _first_hit_full(tok, ids, stops)


def _byte_id(tok, b: int) -> int:
    """The byte tokenizer's id of byte ``b`` (its symbols are GPT-2's printable images of the bytes)."""
    if "map" not in _TOK:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        image = {x: chr(x) for x in printable}
        rest = [x for x in range(256) if x not in image]
        image.update({x: chr(256 + n) for n, x in enumerate(rest)})
        _TOK["map"] = {x: tok.convert_tokens_to_ids(c) for x, c in image.items()}
    return _TOK["map"][b]


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 4095), min_size=1, max_size=30), cut=st.integers(0, 29), width=st.integers(1, 6))
def test_matcher_equals_full_decode_on_the_demo_bpe(ids, cut, width):
    tok = _demo_tok()
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[cut % max(len(text), 1) :][:width] or "x"  # a stop that often occurs
    assert _first_hit(tok, ids, [stop]) == _first_hit_full(tok, ids, [stop])


def test_matcher_hits_across_tokens_and_is_linear(tmp_path_factory):
    """Inverse of a vacuous pass: stops that span tokens are found (a per-token search misses
    them), and the matcher decodes O(1) tokens per push on a long output."""
    tok = _byte_tok(tmp_path_factory)
    ids = [_byte_id(tok, b) for b in b"x" * 500 + "a€b".encode()]
    assert _first_hit(tok, ids, ["a€b"]) == len(ids) - 1
    per_token = next((i for i, t in enumerate(ids) if "a€b" in tok.decode([t])), None)
    assert per_token is None, "a search of each token's own text cannot see a stop spanning tokens"
    calls = []

    class Counting:
        def decode(self, t, skip_special_tokens=True):
            calls.append(len(t))
            return tok.decode(t, skip_special_tokens=skip_special_tokens)

    m = StopMatcher(Counting(), ["zz"])
    for t in ids:
        m.push(t)
    assert sum(calls) <= 6 * len(ids), f"decoded {sum(calls)} tokens for {len(ids)} pushes"


def test_cut_at_stop():
    assert cut_at_stop("abc\n\ndef", ["\n\n", "c"]) == "ab"
    assert cut_at_stop("abc", ["x"]) == "abc"


def test_encode_prompts_and_seeds(tmp_path_factory):
    tok = _byte_tok(tmp_path_factory)
    kw = dict(vocab_size=257, max_seq_len=16, max_batch_size=2)
    assert encode_prompts([1, 2, 3], None, **kw) == [[1, 2, 3]]
    assert encode_prompts("ab", tok, **kw) == [tok("ab")["input_ids"]]
    for bad, msg in (
        ([], "empty"),
        ([[1], [2], [3]], "max_batch_size"),
        ([[300]], "outside the vocabulary"),
        ([list(range(16))], "max_seq_len"),
        ("ab", "tokenizer"),
    ):
        with pytest.raises(ValueError, match=msg):
            encode_prompts(bad, None if msg == "tokenizer" else tok, **kw)
    assert row_seeds(5, 3, SamplingParams(temperature=1.0)) == [5, 5, 5]
    assert row_seeds(None, 2, SamplingParams()) == [0, 0]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        row_seeds([1, 2], 3, SamplingParams(temperature=1.0))
