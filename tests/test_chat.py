"""Chat prompts: conversations rendered by the tokenizer's chat template, ended by its end-of-turn token.

The tiny random pair's byte tokenizer has no chat template and no room for ChatML tokens (its target's
vocabulary is the 256 bytes and ``<eos>``), so this module builds its own pair: a tiny Llama over the
256 bytes plus ``<|endoftext|>`` (256, EOS), ``<|im_start|>`` (257) and ``<|im_end|>`` (258), a ChatML
template, and a random drafter. The target's ``<|im_end|>`` row of ``lm_head`` is scaled up so that
greedy decoding emits it on some prompts.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.runtime.requests import (
    RequestRows,
    chat_ids,
    encode_prompts,
    end_of_turn_ids,
    is_conversation,
    resolve_stop_ids,
)
from tritonspec.runtime.sampling import SamplingParams
from tritonspec.runtime.tiny import byte_tokenizer, tiny_target

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EOS, IM_START, IM_END = 256, 257, 258
VOCAB = 259
# prompts whose greedy continuation on this pair ends its turn early, late, or not within MAX_NEW
STOPS_AT_ONCE, STOPS_LATER, NEVER_STOPS = "2+2?", "tell me a story", "hello"
MAX_NEW = 40


def user(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def chatml_tokenizer(directory):
    """A byte-level BPE tokenizer with ChatML control tokens and a ChatML chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return fast


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-pair")
    tdir, ddir = root / "target", root / "drafter"
    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    model = tiny_target("llama", 0, vocab_size=VOCAB, eos_token_id=EOS, num_hidden_layers=4, **sizes)
    with torch.no_grad():
        model.lm_head.weight[IM_END] *= 5  # greedy ends its turn on some prompts
    model.save_pretrained(str(tdir))
    chatml_tokenizer(tdir)
    ts.Eagle3Drafter.for_target(tdir, seed=0).save_pretrained(ddir)
    return tdir, ddir


@pytest.fixture(scope="module")
def rt(pair):
    return ts.SpeculativeRuntime.from_pretrained(*pair, backend="torch", max_seq_len=160)


@pytest.fixture(scope="module")
def tok(rt):
    return rt.tokenizer


def template_ids(tok, conv: list[dict]) -> list[int]:
    """transformers' own rendering and tokenization (the reference)."""
    out = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode(prompts, tokenizer) -> list[list[int]]:
    return encode_prompts(prompts, tokenizer, vocab_size=VOCAB, max_seq_len=160, max_batch_size=8)


def test_the_tokenizer_is_chatml(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [EOS, IM_START, IM_END]
    assert tok.eos_token_id == EOS and tok.chat_template == CHATML
    text = tok.apply_chat_template(user("hi", system="be brief"), add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_prompts_applies_the_template_exactly(tok):
    one, sys_user = user("hello there"), user("What is 2+2?", system="You are terse.")
    multi = [*user("hi"), {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "bye"}]
    assert encode(one, tok) == [template_ids(tok, one)]  # one conversation: a batch of one
    assert encode(sys_user, tok) == [template_ids(tok, sys_user)]
    assert encode([one, sys_user, multi], tok) == [template_ids(tok, c) for c in (one, sys_user, multi)]
    ids = encode(sys_user, tok)[0]
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2  # control tokens stay whole
    assert ids[-len(tok("assistant\n")["input_ids"]) - 1] == IM_START  # ends with the generation prompt
    assert chat_ids(tok, tuple(one)) == template_ids(tok, one)  # any sequence of message dicts


def test_a_plain_string_stays_raw_text(tok):
    text = "<|im_start|>user\nhi"  # even one that looks like a rendered template
    assert encode(text, tok) == [tok(text)["input_ids"]]
    hello, hi = tok("hello")["input_ids"], tok("hi")["input_ids"]
    assert encode("hello", tok) == [hello] and len(hello) == 5 and IM_START not in hello
    assert encode(["hello", "hi"], tok) == [hello, hi]
    assert not is_conversation("hello") and not is_conversation([1, 2]) and not is_conversation([])
    assert is_conversation(user("hi"))


def test_stop_ids_add_the_end_of_turn_token_for_chat(tok, rt):
    cfg = rt.target.config
    assert end_of_turn_ids(tok) == {IM_END}
    assert resolve_stop_ids(None, tok, cfg, chat=True) == {EOS, IM_END}
    assert resolve_stop_ids(None, tok, cfg) == {EOS}  # raw text: EOS only
    assert resolve_stop_ids([7], tok, cfg, VOCAB, chat=True) == {7}  # the caller's stop ids win
    assert resolve_stop_ids([], tok, cfg, VOCAB, chat=True) == set()
    assert end_of_turn_ids(None) == set()


def test_request_rows_stop_at_the_end_of_turn(tok, rt):
    stops = resolve_stop_ids(None, tok, rt.target.config, chat=True)
    rows = RequestRows(
        [5, 5], max_new_tokens=10, max_seq_len=160, stop_ids=stops, sampling=SamplingParams(), tokenizer=tok
    )
    hi, bang = tok("hi")["input_ids"], tok("!")["input_ids"]
    assert rows.emit([hi + [IM_END] + bang, hi + bang]) == [0]
    assert rows.outs == [hi + [IM_END], hi + bang]
    assert rows.reasons[0] == "stop" and not rows.done[1] and rows.text(0) == "hi"  # the stop token is not text


def test_generate_stops_at_the_end_of_turn(rt, tok):
    for prompt in (STOPS_AT_ONCE, STOPS_LATER, NEVER_STOPS):
        conv = user(prompt)
        ids = template_ids(tok, conv)
        full = rt.generate(conv, max_new_tokens=MAX_NEW, speculative=False, stop_token_ids=[]).token_ids[0]
        raw = rt.generate(ids, max_new_tokens=MAX_NEW, speculative=False)  # token ids: EOS stops, not <|im_end|>
        out = rt.generate(conv, max_new_tokens=MAX_NEW, speculative=False)
        assert EOS not in full, "this pair never emits EOS in MAX_NEW tokens (the scenario's premise)"
        assert raw.token_ids[0] == full and raw.finish_reasons == ["length"]
        if prompt == NEVER_STOPS:
            assert IM_END not in full and out.token_ids[0] == full and out.finish_reasons == ["length"]
            continue
        k = full.index(IM_END)  # the scenario's premise: greedy ends the turn here
        assert (k == 0) == (prompt == STOPS_AT_ONCE) and k < MAX_NEW - 1
        assert out.token_ids[0] == full[: k + 1] and out.finish_reasons == ["stop"]
        assert out.texts[0] == tok.decode(full[:k], skip_special_tokens=True) and "<|im_end|>" not in out.texts[0]


def test_batch_of_conversations_equals_rendered_ids_with_chat_stops(rt, tok):
    convs = [user(STOPS_LATER), user(NEVER_STOPS, system="be brief"), user(STOPS_AT_ONCE)]
    out = rt.generate(convs, max_new_tokens=MAX_NEW, speculative=False)
    ref = rt.generate(
        [template_ids(tok, c) for c in convs], max_new_tokens=MAX_NEW, speculative=False, stop_token_ids=[EOS, IM_END]
    )
    assert out.token_ids == ref.token_ids and out.finish_reasons == ref.finish_reasons
    assert out.finish_reasons == ["stop", "length", "stop"]


def test_speculative_chat_equals_plain(rt, tok):
    convs = [user(STOPS_LATER), user(NEVER_STOPS, system="be brief"), user(STOPS_AT_ONCE), user("why?")]
    plain = rt.generate(convs, max_new_tokens=MAX_NEW, speculative=False)
    spec = rt.generate(convs, max_new_tokens=MAX_NEW, speculative=True)
    assert spec.stats.spec is not None and plain.stats.spec is None
    assert spec.token_ids == plain.token_ids and spec.finish_reasons == plain.finish_reasons
    assert spec.texts == plain.texts
    one = rt.generate(convs[0], max_new_tokens=MAX_NEW)  # one conversation, speculative by default
    assert one.token_ids == plain.token_ids[:1] and one.finish_reasons == ["stop"]


@pytest.mark.parametrize("speculative", [False, True])
def test_stream_accepts_one_conversation(rt, speculative):
    conv = user(STOPS_LATER)
    pieces = list(rt.stream(conv, max_new_tokens=MAX_NEW, speculative=speculative))
    ref = rt.generate(conv, max_new_tokens=MAX_NEW, speculative=False)
    assert [t for p in pieces for t in p.token_ids] == ref.token_ids[0]
    assert "".join(p.text for p in pieces) == ref.texts[0]
    assert pieces[-1].finish_reason == "stop"
    with pytest.raises(ts.UserError, match="stream\\(\\) takes one prompt"):
        next(rt.stream([conv, conv]))


CONV = user("hi")


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([{"role": "user"}], r'prompt 0, message 0: needs a "content" string \(got None\)'),
        ([{"content": "hi"}], r'prompt 0, message 0: needs a "role" string'),
        ([{"role": "user", "content": 3}], r'needs a "content" string \(got 3\)'),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], r'needs a "content" string'),
        ([{"role": None, "content": "hi"}], r'needs a "role" string'),
        ([{"role": "user", "content": "hi"}, "hello"], r"prompt 0, message 1: is a str; each message is a dict"),
        ([*CONV, [*CONV]], r"prompt 0, message 1: is a list"),
        ([CONV, {"role": "user", "content": "hi"}], r"prompt 1 is one message dict: wrap it in a list"),
        ({"role": "user", "content": "hi"}, r"prompts of type dict are not accepted.*chat messages \(a list of"),
        ([CONV, [{"role": "user"}]], r"prompt 1, message 0: needs a \"content\" string"),
    ],
)
def test_bad_message_structures_are_user_errors(tok, prompts, message):
    with pytest.raises(ts.UserError, match=message):
        encode(prompts, tok)


def test_a_mix_of_strings_and_conversations_is_refused(tok):
    # chat rows stop at the end of turn and raw rows do not: one batch cannot honour both
    with pytest.raises(ts.UserError, match="mixes chat conversations and raw prompts"):
        encode(["hello", CONV], tok)
    with pytest.raises(ts.UserError, match="mixes chat conversations and raw prompts"):
        encode([CONV, [5, 6]], tok)


def test_a_tokenizer_without_chat_template_is_a_user_error(tmp_path, pair):
    plain = byte_tokenizer(tmp_path)  # the tiny random pair's tokenizer: no chat template
    assert not getattr(plain, "chat_template", None) and end_of_turn_ids(plain) == set()
    with pytest.raises(ts.UserError, match="has no chat template"):
        encode(CONV, plain)
    with pytest.raises(ts.UserError, match="need a tokenizer with a chat template"):
        encode(CONV, None)
    rt = ts.SpeculativeRuntime.from_pretrained(pair[0], backend="torch", max_seq_len=64, tokenizer=plain)
    with pytest.raises(ts.UserError, match="has no chat template"):
        rt.generate(CONV, max_new_tokens=2)
    assert resolve_stop_ids(None, plain, rt.target.config, chat=True) == {plain.eos_token_id}


NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"


def test_named_templates_and_templates_that_refuse(pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair[0]))
    tok.chat_template = {"default": CHATML, "tool_use": CHATML}  # named templates (a dict)
    assert end_of_turn_ids(tok) == {IM_END}
    assert encode(CONV, tok) == [template_ids(tok, CONV)]
    tok.chat_template = NO_SYSTEM + CHATML  # as Gemma's: a system message is refused by the template itself
    assert encode(CONV, tok) == [template_ids(tok, CONV)]
    with pytest.raises(ts.UserError, match="prompt 0: the tokenizer's chat template cannot render it: .*System role"):
        encode(user("hi", system="be brief"), tok)


def test_cli_generate_chat(pair, rt, capsys):
    tdir, ddir = pair
    base = ["generate", "--target", str(tdir), "--drafter", str(ddir), "--max-new-tokens", str(MAX_NEW)]
    base += ["--backend", "torch", "--max-seq-len", "160", "--quiet-stats"]
    ref = rt.generate(user(STOPS_LATER, system="be brief"), max_new_tokens=MAX_NEW, speculative=False)
    assert main([*base, "--chat", "--system", "be brief", STOPS_LATER]) == 0
    out = capsys.readouterr()
    assert out.out == ref.texts[0] + "\n"
    assert f"new_tokens={len(ref.token_ids[0])} " in out.err and "mode=speculative" in out.err
    assert main([*base, "--chat", "--stream", STOPS_AT_ONCE]) == 0  # ends its turn at once: empty text
    out = capsys.readouterr()
    assert out.out == "\n" and "new_tokens=1 " in out.err
    assert main([*base, "--system", "be brief", STOPS_LATER]) == 2
    err = capsys.readouterr().err
    assert err == "tritonspec generate: error: --system needs --chat\n"


def test_cli_chat_errors_are_one_line(pair, tmp_path, capsys):
    from transformers import AutoTokenizer

    tdir = tmp_path / "target"
    shutil.copytree(pair[0], tdir)
    tok = AutoTokenizer.from_pretrained(str(tdir))
    tok.chat_template = NO_SYSTEM + CHATML
    tok.save_pretrained(str(tdir))
    base = ["generate", "--target", str(tdir), "--max-new-tokens", "4", "--backend", "torch", "--max-seq-len", "64"]
    assert main([*base, "--chat", "hi"]) == 0
    capsys.readouterr()
    assert main([*base, "--chat", "--system", "be brief", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "System role not supported" in err
