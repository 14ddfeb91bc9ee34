"""Stop strings (exact, in batch, rows stopping at different rounds) and streaming."""

from __future__ import annotations

import pytest

import tritonspec as ts
from tritonspec.runtime.tiny import byte_tokenizer

from _util import perm_pair, runtime


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    tok = byte_tokenizer(tmp_path_factory.mktemp("tok"))
    model, drafter = perm_pair("llama", vocab=257, seed=4, alpha=0.1)
    return runtime(
        model,
        drafter,
        ts.SpecConfig(num_speculative_tokens=4, top_k=2, num_draft_tokens=8),
        tokenizer=tok,
        max_seq_len=96,
    )


PROMPTS = ["def f(x):", "import os\n", "class A:\n    pass"]


def printable_substring(text: str, start: int) -> str:
    for i in range(start, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s and s.isprintable() and s.strip():
            return s
    pytest.skip("no printable 2-character substring in this model's output")


def test_stop_strings_are_exact_in_batch(rt):
    full = rt.generate(PROMPTS, max_new_tokens=40)
    assert full.stats.mean_acceptance_length > 1.5, "rounds must emit several tokens for this test to bite"
    stop = printable_substring(full.texts[1], 6)
    out = rt.generate(PROMPTS, max_new_tokens=40, stop=[stop])
    ends = []
    for f_ids, f_text, ids, text, why in zip(full.token_ids, full.texts, out.token_ids, out.texts, out.finish_reasons):
        if stop in f_text:
            assert text == f_text[: f_text.index(stop)] and why == "stop"
            tok = rt.tokenizer
            assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1]), "tokens end where the stop completed"
            assert ids == f_ids[: len(ids)]
        else:
            assert (ids, text, why) == (f_ids, f_text, "length")
        ends.append(len(ids))
    assert len(set(ends)) > 1, "rows must stop at different rounds"


def test_stream_concatenates_to_generate_text(rt):
    for kw in (dict(), dict(temperature=0.8, seed=3), dict(stop=["\n"]), dict(max_new_tokens=7)):
        args = dict(max_new_tokens=40) | kw
        whole = rt.generate([PROMPTS[0]], **args)
        pieces = list(rt.stream(PROMPTS[0], **args))
        assert "".join(p.text for p in pieces) == whole.texts[0]
        assert [t for p in pieces for t in p.token_ids] == whole.token_ids[0]
        assert pieces[-1].stats is not None and pieces[-1].finish_reason == whole.finish_reasons[0]
        assert all("\ufffd" not in p.text or p is pieces[-1] or "\ufffd" in whole.texts[0] for p in pieces)
        assert len(pieces) > 2 or len(whole.token_ids[0]) < 8


def test_stream_holds_back_incomplete_utf8(tmp_path):
    """A 3-byte character split across rounds is never emitted half-done."""
    tok = byte_tokenizer(tmp_path)
    a, euro, b = tok("a")["input_ids"], tok("€")["input_ids"], tok("b")["input_ids"]
    assert len(euro) == 3 and tok.decode(euro[:2]).endswith("\ufffd")
    model, drafter = perm_pair("llama", vocab=257, seed=4, alpha=0.05, chain=a + euro + b)
    rt = runtime(model, drafter, ts.SpecConfig.chain(1), tokenizer=tok, max_seq_len=64)
    whole = rt.generate(a, max_new_tokens=8)
    assert whole.texts[0].startswith("€b"), whole.texts[0]
    pieces = list(rt.stream(a, max_new_tokens=8))
    assert "".join(p.text for p in pieces) == whole.texts[0]
    assert all(not p.text.endswith("\ufffd") for p in pieces[:-1])
    assert len([p for p in pieces if p.text]) >= 3, "the text must arrive in several pieces"


def test_stream_rejects_batches(rt):
    with pytest.raises(ValueError, match="one prompt"):
        list(rt.stream([[1, 2], [3]]))
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        rt.generate(PROMPTS[:1], stop=[""])
