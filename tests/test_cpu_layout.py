"""The CPU weight layout (issue 21): projection weights stored ``[K, N]`` (``weight_layout="kn"``) with
q/k/v and gate/up fused give the loaded layout's results within float rounding, the same greedy
tokens, speculative = plain bit for bit, no second copy of the weights, and save the original
layout; bfloat16 on a CPU without bf16 instructions warns once."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

import tritonspec as ts
from tritonspec.runtime import target as target_mod
from tritonspec.runtime.metadata import AttentionMetadata
from tritonspec.runtime.ops import TorchOps

from _util import perm_pair, random_prompts, tiny_target

ARCHS = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases; qwen3: q/k norms


def full_logits(tm: ts.TargetModel, tokens: list[int]) -> torch.Tensor:
    """``[T, V]`` logits of one causal forward over ``tokens``."""
    T = len(tokens)
    tm.allocate_cache(1, T + 1)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    meta = AttentionMetadata(pos, pos, torch.zeros(1, dtype=torch.int64), causal, T)
    hidden, _ = tm.forward(TorchOps(), torch.tensor([tokens]), meta, capture_aux=False)
    return tm.logits(hidden, TorchOps())[0]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    tiny_target(request.param, seed=3, vocab_size=96).save_pretrained(str(d))
    return d


def test_layouts_agree_within_float_rounding(model_dir):
    nk = ts.TargetModel.from_pretrained(model_dir, weight_layout="nk")
    kn = ts.TargetModel.from_pretrained(model_dir, weight_layout="kn")
    assert kn.layers[0].wqkv.stride() == (1, kn.layers[0].wqkv.shape[0])  # stored [K, N]
    assert nk.layers[0].wqkv.is_contiguous()
    for prompt in random_prompts(96, [1, 7, 33], seed=0):
        a, b = full_logits(nk, prompt), full_logits(kn, prompt)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_layouts_give_the_same_greedy_tokens(model_dir):
    outs = {}
    for lay in ("nk", "kn"):
        tm = ts.TargetModel.from_pretrained(model_dir, weight_layout=lay)
        rt = ts.SpeculativeRuntime(tm, None, None, max_batch_size=4, max_seq_len=96)
        prompts = random_prompts(96, [3, 9, 1, 20], seed=1)
        outs[lay] = rt.generate(prompts, max_new_tokens=24, speculative=False).token_ids
    assert outs["kn"] == outs["nk"]


@pytest.mark.parametrize("spec", [ts.SpecConfig.chain(3), ts.SpecConfig(3, 2, 6)], ids=["chain", "tree"])
def test_speculative_over_the_prepared_layout(spec):
    """Greedy: speculative = plain, bit for bit. Seeded sampling: the prepared layout's speculative
    output equals the loaded layout's (sampling is lossless in law, not sample for sample)."""
    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.15)
    rts = {}
    for lay in ("nk", "kn"):
        tm = ts.TargetModel.from_pretrained(model, weight_layout=lay)
        rts[lay] = ts.SpeculativeRuntime(tm, drafter, None, spec=spec, max_batch_size=4, max_seq_len=96)
    prompts = random_prompts(24, [2, 5, 11, 4], seed=2)
    for batch in (prompts[:1], prompts):
        spec_out = rts["kn"].generate(batch, max_new_tokens=20)
        assert spec_out.token_ids == rts["kn"].generate(batch, max_new_tokens=20, speculative=False).token_ids
        sampled = [rts[lay].generate(batch, max_new_tokens=20, temperature=1.0, seed=7).token_ids for lay in rts]
        assert sampled[0] == sampled[1]
    assert spec_out.stats.mean_acceptance_length > 1.5  # the drafter is accepted: not vacuous


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("tied", [True, False])
def test_prepared_weights_replace_the_originals(tmp_path, tied):
    tiny_target("llama", seed=1, vocab_size=96, tie_word_embeddings=tied).save_pretrained(str(tmp_path))
    original = load_file(str(tmp_path / "model.safetensors"))
    tm = ts.TargetModel.from_pretrained(tmp_path, weight_layout="kn")
    held = [tm.embed, tm.lm_head, tm.norm] + [t for L in tm.layers for t in vars(L).values() if torch.is_tensor(t)]
    # no second copy of anything (the tied head shares the embedding's storage)
    assert storage_bytes(held) == sum(t.numel() * t.element_size() for t in original.values())
    assert (tm.lm_head is tm.embed) == tied


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saving_writes_the_original_layout_and_dtype(tmp_path, layout, dtype):
    src, out = tmp_path / "src", tmp_path / "out"
    tiny_target("qwen2", seed=2, vocab_size=96).save_pretrained(str(src))
    original = load_file(str(src / "model.safetensors"))
    tm = ts.TargetModel.from_pretrained(src, dtype=dtype, weight_layout=layout)
    tm.save_pretrained(out)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == original.keys()
    for k, v in original.items():
        assert saved[k].dtype == dtype and saved[k].is_contiguous() and torch.equal(saved[k], v.to(dtype)), k
    again = ts.TargetModel.from_pretrained(out, dtype=dtype, weight_layout=layout)
    prompt = random_prompts(96, [9], seed=4)[0]
    assert torch.equal(full_logits(again, prompt), full_logits(tm, prompt))


def test_bfloat16_without_cpu_bf16_instructions_warns_once(tmp_path, monkeypatch):
    """No bf16 instructions and no CPU kernels (which make bfloat16 the fast path, AVX2 included): one
    warning; with the kernels, or with bf16 instructions, none."""
    tiny_target("llama", seed=1, vocab_size=96).save_pretrained(str(tmp_path))
    monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(target_mod._cpu_linear, "available", lambda dtype: "no kernels (test)")
    with pytest.warns(UserWarning, match="without bf16 instructions") as rec:
        tm = ts.TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert len([w for w in rec if "bf16" in str(w.message)]) == 1
    rt = ts.SpeculativeRuntime(tm, None, None, max_seq_len=64)
    assert len(rt.generate([[1, 2, 3]], max_new_tokens=4).token_ids[0]) == 4  # it still runs
    monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16)  # the inverse: no warning
        ts.TargetModel.from_pretrained(tmp_path, dtype=torch.float32)
        monkeypatch.setattr(target_mod, "cpu_has_bf16", lambda: False)
        monkeypatch.setattr(target_mod._cpu_linear, "available", lambda dtype: None)  # the kernels run bf16
        ts.TargetModel.from_pretrained(tmp_path, dtype=torch.bfloat16)


def test_bad_layout_is_a_user_error(tmp_path):
    tiny_target("llama", seed=1, vocab_size=96).save_pretrained(str(tmp_path))
    with pytest.raises(ts.UserError, match="weight_layout='kx'"):
        ts.TargetModel.from_pretrained(tmp_path, weight_layout="kx")
