"""Issue 14's hardening, one test per item: concurrent use (1), target weights against the config
(3), tiny temperatures and non-finite logits (4), user errors as ``UserError`` / CLI exit 2 (5), CLI
zeros (6), a drafter shared between runtimes (7), CLI stop-string escapes (8), type checks (9) and
the integer types transformers users pass (10). The table of bad inputs is ``test_bad_inputs.py``;
export safety (item 2) is tested with the exporter."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.cli.common import unescape
from tritonspec.kernels import store
from tritonspec.kernels.store import TunedConfigWarning, make_table, write_table
from tritonspec.kernels.tree_attention import attention_config

from _util import perm_pair, random_prompts, runtime

CODE = "import os\nimport sys\n"

pytestmark = pytest.mark.skipif(not ts.demo.available(), reason="the bundled demo pair is not built")


@pytest.fixture(scope="module")
def demo_rt():
    return ts.SpeculativeRuntime.from_pretrained(*ts.demo_pair(), max_batch_size=4, max_seq_len=256)


# ------------------------------------------------------------------------------------------ item 1
def test_stream_interleaved_with_generate_refuses_and_keeps_the_stream_right(demo_rt):
    rt = demo_rt
    ref = rt.generate(CODE, max_new_tokens=30).token_ids[0]
    it = rt.stream(CODE, max_new_tokens=30)
    ids = next(it).token_ids + next(it).token_ids
    with pytest.raises(ts.UserError, match="stream of this runtime .* is still open in this thread"):
        rt.generate("for i in range(10):", max_new_tokens=30)
    with pytest.raises(ts.UserError, match="still open"):
        next(rt.stream("x = 1", max_new_tokens=4))
    ids += [t for piece in it for t in piece.token_ids]
    assert ids == ref  # the open stream was not disturbed
    it = rt.stream(CODE, max_new_tokens=30)  # a stream broken off (closed) releases the runtime
    next(it)
    it.close()
    assert rt.generate(CODE, max_new_tokens=30).token_ids[0] == ref


def test_two_threads_get_the_reference_tokens(demo_rt):
    rt = demo_rt
    prompts = [CODE, "for i in range(10):", "def add(a, b):", "class Point:"]
    kw = dict(max_new_tokens=24)
    refs = {p: rt.generate(p, **kw).token_ids[0] for p in prompts}
    sampled = rt.generate(prompts[:2], temperature=0.8, seed=7, **kw).token_ids
    got, errors = [], []

    def generate(order):
        try:
            for p in order:
                got.append((p, rt.generate(p, **kw).token_ids[0]))
            got.append(("sampled", rt.generate(prompts[:2], temperature=0.8, seed=7, **kw).token_ids))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def stream_slowly():
        try:
            ids = []
            for piece in rt.stream(prompts[2], **kw):
                ids += piece.token_ids
                time.sleep(0.002)  # the stream stays open while the other threads want the runtime
            got.append((prompts[2], ids))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [
        threading.Thread(target=generate, args=(prompts,)),
        threading.Thread(target=generate, args=(prompts[::-1],)),
        threading.Thread(target=stream_slowly),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert len(got) == 2 * (len(prompts) + 1) + 1
    for p, ids in got:
        assert ids == (sampled if p == "sampled" else refs[p]), p


def test_runtimes_sharing_a_target_are_serialised_too():
    model, drafter = perm_pair("llama", vocab=24, seed=1)
    tm = ts.TargetModel.from_pretrained(model)
    a = ts.SpeculativeRuntime(tm, drafter, spec=ts.SpecConfig(2, 2, 4), max_seq_len=64, cuda_graphs=False)
    b = ts.SpeculativeRuntime(tm, None, max_seq_len=64, cuda_graphs=False)
    it = a.stream([1, 2, 3], max_new_tokens=8)
    next(it)
    with pytest.raises(ts.UserError, match="still open"):  # b's generate would overwrite a's KV cache
        b.generate([4, 5], max_new_tokens=4, speculative=False)
    it.close()
    b.generate([4, 5], max_new_tokens=4, speculative=False)


# ------------------------------------------------------------------------------------------ item 3
@pytest.fixture
def target_copy(tmp_path):
    """A writable copy of the demo target and a function that edits its config and tensors."""
    src, _ = ts.demo_pair()
    dst = tmp_path / "target"
    shutil.copytree(src, dst)

    def edit(config=None, tensors=None):
        if config:
            cfg = json.loads((dst / "config.json").read_text())
            (dst / "config.json").write_text(json.dumps(cfg | config))
        if tensors:
            state = load_file(str(dst / "model.safetensors"))
            tensors(state)
            save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
        return dst

    return edit


def _transpose(state):
    k = "model.layers.3.mlp.gate_proj.weight"
    state[k] = state[k].t()


def _shrink_lm_head(state):
    state["lm_head.weight"] = state["lm_head.weight"][:4000]


def _extra_bias(state):
    state["model.layers.0.mlp.down_proj.bias"] = torch.zeros(128)


def _drop(state):
    del state["model.layers.5.self_attn.k_proj.weight"]


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"num_hidden_layers": 10}, None, r"num_hidden_layers=10 but the weights hold layers 0-11"),
        ({"num_hidden_layers": 14}, None, r"num_hidden_layers=14 but the weights hold layers 0-11"),
        (None, _transpose, r"layers.3.mlp.gate_proj.weight: expected \(384, 128\), found \(128, 384\)"),
        (None, _shrink_lm_head, r"lm_head.weight: expected \(4096, 128\), found \(4000, 128\)"),
        ({"vocab_size": 4000}, None, r"embed_tokens.weight: expected \(4000, 128\), found \(4096, 128\)"),
        (None, _extra_bias, r"does not use: \['layers.0.mlp.down_proj.bias'\]"),
        (None, _drop, r"lack \['layers.5.self_attn.k_proj.weight'\]"),
    ],
    ids=["fewer-layers", "more-layers", "transposed", "lm-head-rows", "vocab", "unexpected", "missing"],
)
def test_target_weights_must_agree_with_the_config(target_copy, config, tensors, message):
    d = target_copy(config, tensors)
    with pytest.raises(ts.UserError, match=message):
        ts.TargetModel.from_pretrained(d)


def test_target_weights_check_accepts_every_supported_family():
    for arch in ("llama", "mistral", "qwen2", "qwen3"):  # biases, q/k norms, tied embeddings
        model = random_tiny(arch)
        tm = ts.TargetModel.from_pretrained(model)
        assert tm.num_layers == model.config.num_hidden_layers


def random_tiny(arch):
    from tritonspec.runtime.tiny import tiny_target

    return tiny_target(arch, tie_word_embeddings=arch == "qwen3")


# ------------------------------------------------------------------------------------------ item 4
def test_tiny_temperatures_approach_greedy(demo_rt):
    greedy = demo_rt.generate(CODE, max_new_tokens=12).token_ids
    for t in (1e-38, 1e-30, 1e-6):
        out = demo_rt.generate(CODE, max_new_tokens=12, temperature=t, seed=1)
        assert out.token_ids == greedy, t
        assert out.finish_reasons == ["length"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("speculative", [True, False])
def test_non_finite_logits_raise(temperature, speculative):
    model, drafter = perm_pair("llama", vocab=24, seed=1)
    rt = runtime(model, drafter, spec=ts.SpecConfig(2, 2, 4), max_seq_len=64, cuda_graphs=False)
    kw = dict(max_new_tokens=8, temperature=temperature, seed=0, speculative=speculative)
    prompt = random_prompts(24, [5], seed=0)[0]
    ref = rt.generate(prompt, **kw).token_ids
    it = rt.stream(prompt, **kw)
    next(it)  # the prefill ran on good weights
    saved = rt.target.norm.clone()
    rt.target.norm.fill_(float("nan"))  # now a decode round's hidden states are NaN
    with pytest.raises(ts.UserError, match=r"not finite \(NaN or inf\) for batch rows \[0\] during decoding"):
        next(it)
    it.close()
    with pytest.raises(ts.UserError, match="during prefill"):  # a NaN weight fails at once
        rt.generate(prompt, **kw)
    rt.target.norm.copy_(saved)
    assert rt.generate(prompt, **kw).token_ids == ref  # the runtime is usable again


# ------------------------------------------------------------------------------------------ item 5
def test_user_errors_are_one_family(monkeypatch, capsys):
    assert issubclass(ts.UserError, ValueError)
    if not torch.cuda.is_available():
        with pytest.raises(ts.UserError, match="device='cuda': no CUDA device"):
            ts.SpeculativeRuntime.from_pretrained(ts.demo_pair()[0], device="cuda")
    with pytest.raises(ts.UserError, match="device='gpu' is not a device name"):
        ts.SpeculativeRuntime.from_pretrained(ts.demo_pair()[0], device="gpu")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ts.UserError, match="backend='triton' on a machine without CUDA"):
            ts.SpeculativeRuntime.from_pretrained(ts.demo_pair()[0], backend="triton")
        assert main(["generate", "--target", "demo", "--backend", "triton", "x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tritonspec generate: error: backend='triton'") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------ item 6
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-speculative-tokens", "0"], "num_speculative_tokens=0 must be >= 1"),
        (["--draft-top-k", "0"], "top_k=0 must be >= 1"),
        (["--num-draft-tokens", "0"], "num_draft_tokens=0 must be >= 2"),
    ],
)
def test_cli_zero_shape_flags_are_refused(flags, message, capsys):
    assert main(["generate", "--target", "demo", *flags, "--max-new-tokens", "2", "x"]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ item 7
def test_a_shared_drafter_is_not_moved_under_another_runtime():
    model, drafter = perm_pair("llama", vocab=24, seed=1)
    spec = ts.SpecConfig(2, 2, 4)
    a = runtime(model, drafter, spec=spec, max_seq_len=64)
    prompt = random_prompts(24, [5], seed=0)[0]
    ref = a.generate(prompt, max_new_tokens=10).token_ids
    b = runtime(model, drafter, spec=spec, max_seq_len=64, dtype=torch.bfloat16)
    assert b.drafter is not drafter and b.drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.fc.weight.dtype == torch.float32 and a.drafter is drafter  # the caller's module as it was
    b.generate(prompt, max_new_tokens=10)
    assert a.generate(prompt, max_new_tokens=10).token_ids == ref
    c = runtime(random_tiny_like(model), drafter, spec=spec, max_seq_len=64)  # another target, same shapes
    assert c.drafter is not drafter  # a's drafter keeps a's embedding (not re-attached to c's target)
    assert a.drafter.embed_tokens.weight.data_ptr() == a.target.embed.data_ptr()
    assert a.generate(prompt, max_new_tokens=10).token_ids == ref
    drafter.to(torch.bfloat16)  # the caller moves its own module: detected, not a dtype error deep in torch
    with pytest.raises(ts.UserError, match="the drafter was moved to cpu / torch.bfloat16"):
        a.generate(prompt, max_new_tokens=10)


def random_tiny_like(model):
    from tritonspec.runtime.tiny import tiny_target

    return tiny_target("llama", seed=5, vocab_size=model.config.vocab_size)


# ------------------------------------------------------------------------------------------ item 8
def test_unescape():
    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\n\x41\u00e9") == "a\tb\\nAé"
    assert unescape("é\\q") == "é\\q"  # unknown escapes and non-ASCII text stay as they are


def test_cli_stop_string_escapes_stop(demo_rt, capsys):
    want = demo_rt.generate(CODE, max_new_tokens=40, stop=["\n"])
    assert want.finish_reasons == ["stop"]
    assert main(["generate", "--target", "demo", "--max-new-tokens", "40", "--stop", r"\n", CODE]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == want.texts[0] and "\n" not in want.texts[0]
    assert out.splitlines()[1].startswith(f"[tritonspec] new_tokens={len(want.token_ids[0])} ")


# ------------------------------------------------------------------------------------------ item 9
def test_spec_config_checks_types():
    for args, bad in (((2.5, 1, 3), "2.5"), ((True, True, 2), "True"), ((3, "2", 5), "'2'"), ((3, 2, 5.0), "5.0")):
        with pytest.raises(ts.UserError, match=f"={bad} must be an integer"):
            ts.SpecConfig(*args)
    with pytest.raises(ts.UserError, match="sample_chain_drafts=1 must be True or False"):
        ts.SpecConfig(3, 1, 4, sample_chain_drafts=1)
    s = ts.SpecConfig(np.int64(3), torch.tensor(2), 5)  # numpy / torch integers are integers
    assert s == ts.SpecConfig(3, 2, 5) and type(s.top_k) is int and hash(s) == hash(ts.SpecConfig(3, 2, 5))


@pytest.mark.parametrize(
    "config, why",
    [
        ({"BLOCK_M": 48, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_kv": 256}, "BLOCK_M=48"),
        ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 6, "num_stages": 2, "split_kv": 256}, "num_warps=6"),
    ],
)
def test_kernel_configs_need_power_of_two_tiles(tuned_dir, config, why):
    table = make_table("tree_attention", "head_dim", {64: config}, dtype="float32", device="cpu")
    write_table(table, tuned_dir)
    store.clear_cache()
    with pytest.warns(TunedConfigWarning, match=f"{why} is not a power of two"):
        cfg = attention_config(64, torch.float32, torch.device("cpu"))
    assert cfg["BLOCK_M"] == 64 and cfg["num_warps"] == 4  # the heuristic default


def test_stop_ids_and_token_ids_are_checked(demo_rt):
    for kw, message in (
        (dict(stop_token_ids=[99999]), r"stop_token_ids \[99999\] lie outside the vocabulary \[0, 4096\)"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids \[-1\] lie outside"),
        (dict(stop_token_ids=[1.5]), r"not integer token ids: \[1.5\]"),
        (dict(stop_token_ids=5), r"stop_token_ids=5: pass a list of token ids"),
        (dict(prompts=b"abc"), "prompts=b'abc' is bytes"),
        (dict(prompts=[1.0, 2.0]), r"prompt 0 has token ids that are not integers: \[1.0, 2.0\]"),
        (dict(prompts=[[1, 2], [3, True]]), r"prompt 1 has token ids that are not integers: \[True\]"),
    ):
        with pytest.raises(ts.UserError, match=message):
            demo_rt.generate(**({"prompts": CODE} | kw), max_new_tokens=2)


# ------------------------------------------------------------------------------------------ item 10
def test_numpy_and_torch_integers_and_tensor_prompts(demo_rt):
    rt = demo_rt
    ids = rt.tokenizer(CODE)["input_ids"]
    other = rt.tokenizer("def f(x):")["input_ids"][: len(ids)]
    ids = ids[: len(other)]
    kw = dict(max_new_tokens=6, temperature=0.9)
    want = rt.generate([ids, other], seed=3, **kw).token_ids
    for seed in (np.int64(3), torch.tensor(3), np.array([3, 3]), [np.int32(3), torch.tensor(3)]):
        assert rt.generate([ids, other], seed=seed, **kw).token_ids == want, seed
    for prompts in (torch.tensor([ids, other]), np.array([ids, other]), [torch.tensor(ids), np.array(other)]):
        assert rt.generate(prompts, seed=3, **kw).token_ids == want, type(prompts)
    # one prompt alone: batch 1 may run another tuned tree shape than batch 2 (its own sampled tokens)
    alone = rt.generate([ids], seed=3, **kw).token_ids
    assert rt.generate(torch.tensor(ids), seed=3, **kw).token_ids == alone
    assert [t for p in rt.stream(torch.tensor(ids), seed=3, **kw) for t in p.token_ids] == alone[0]
    assert rt.generate(ids, max_new_tokens=np.int64(3)).token_ids == rt.generate(ids, max_new_tokens=3).token_ids


def test_ordinary_mistakes_get_clear_messages(demo_rt, capsys):
    with pytest.raises(ts.UserError, match="tokenizer='gpt2' is not a directory with tokenizer files"):
        ts.SpeculativeRuntime.from_pretrained(ts.demo_pair()[0], tokenizer="gpt2")
    with pytest.raises(ts.UserError, match="1-D .* or 2-D .* integer tensor, got 3-D"):
        demo_rt.generate(torch.zeros(1, 2, 3, dtype=torch.int64))
    with pytest.raises(ts.UserError, match="prompts of type dict are not accepted: pass a string"):
        demo_rt.generate({"text": "x"})
    assert main(["bench", "--num-prompts", "0"]) == 2
    assert "--num-prompts 0 must be >= 1" in capsys.readouterr().err
