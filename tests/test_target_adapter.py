"""The target adapter's forward against transformers' forward of the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tritonspec.runtime.metadata import AttentionMetadata
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.target import TargetModel

from _util import hf_greedy, random_prompts, runtime, tiny_target

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def adapter_logits(tm: TargetModel, ids: list[int]) -> torch.Tensor:
    """Prefill logits of our forward for one prompt: [T, V]."""
    T = len(ids)
    tm.allocate_cache(1, T + 4)
    tok = torch.tensor([ids])
    pos = torch.arange(T)[None]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    hidden, _ = tm.forward(TorchOps(), tok, AttentionMetadata(pos, pos, torch.zeros(1, dtype=torch.int64), mask, T))
    return tm.logits(hidden)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    model = tiny_target(arch, seed=3)
    ids = random_prompts(97, [23], seed=1)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    ours = adapter_logits(TargetModel.from_pretrained(model), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert not torch.equal(ours, adapter_logits(TargetModel.from_pretrained(tiny_target(arch, seed=4)), ids))


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_scaling_matches_transformers(rope):
    model = tiny_target("llama", seed=5, rope_scaling=rope)
    ids = random_prompts(97, [70], seed=2)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(adapter_logits(TargetModel.from_pretrained(model), ids), ref, atol=2e-4, rtol=1e-4)


def test_tied_embeddings_and_directory_load(tmp_path):
    model = tiny_target("qwen2", seed=6, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    ids = random_prompts(97, [9], seed=3)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    tm = TargetModel.from_pretrained(tmp_path)
    assert tm.lm_head is tm.embed
    torch.testing.assert_close(adapter_logits(tm, ids), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_greedy_equals_transformers_generate(arch):
    model = tiny_target(arch, seed=7)
    rt = runtime(model)
    prompts = random_prompts(97, [5, 12], seed=4)
    out = rt.generate(prompts, max_new_tokens=24, speculative=False)
    for p, got in zip(prompts, out.token_ids):
        assert got == hf_greedy(model, p, 24)


def test_unknown_architecture_lists_supported(tmp_path):
    model = tiny_target("llama", seed=0)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        TargetModel.from_pretrained(tmp_path)


def test_missing_and_corrupt_weight_files_are_named(tmp_path):
    model = tiny_target("llama", seed=0)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="corrupt weight file .*model.safetensors"):
        TargetModel.from_pretrained(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        TargetModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetModel.from_pretrained(tmp_path / "nope")


def test_aux_boundaries_are_the_residual_stream():
    """Boundary b = residual stream entering layer b = transformers' hidden_states[b]."""
    model = tiny_target("llama", seed=8)
    ids = random_prompts(97, [11], seed=5)[0]
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    tm = TargetModel.from_pretrained(model)
    tm.set_aux_layer_ids((0, 2, 5))
    T = len(ids)
    tm.allocate_cache(1, T)
    pos = torch.arange(T)[None]
    meta = AttentionMetadata(
        pos, pos, torch.zeros(1, dtype=torch.int64), torch.ones(T, T, dtype=torch.bool).tril()[None], T
    )
    _, aux = tm.forward(TorchOps(), torch.tensor([ids]), meta)
    H = tm.hidden_size
    for j, b in enumerate((0, 2, 5)):
        torch.testing.assert_close(aux[0, :, j * H : (j + 1) * H], hs[b][0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"out of range for a target with 6 layers"):
        tm.set_aux_layer_ids((2, 3, 7))
