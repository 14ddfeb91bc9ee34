"""Tiny random Llama-family models for tests, examples and the CLI's ``--target tiny-random``.

Deliberately odd sizes (hidden 72, 3 KV heads, vocab 97) catch shape bugs that powers of two hide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small transformers config of the given family (odd sizes by default)."""
    import transformers

    base = dict(
        hidden_size=72,
        intermediate_size=112,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=6,
        vocab_size=97,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**base)
    if arch == "mistral":
        return transformers.MistralConfig(**{"sliding_window": None, **base})
    if arch == "qwen2":
        return transformers.Qwen2Config(**base)
    if arch == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 16, **base})
    raise ValueError(f"arch={arch!r}: use one of {ARCHS}")


def tiny_target(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A seeded random transformers causal LM (float32, eval mode).

    Weights get a larger scale than transformers' init (std 0.02) so the logits are peaked and
    greedy decoding is far from ties, as in a trained model.
    """
    import transformers

    cfg = tiny_config(arch, **overrides)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[1]) ** 0.5)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def byte_tokenizer(directory: str | Path) -> Any:
    """Write and load a byte-level tokenizer (256 byte tokens + ``<eos>``) into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(directory))
    return fast


def tiny_random_pair(
    directory: str | Path, arch: str = "llama", seed: int = 0, fc_norm: bool = True, norm_output: bool = True
) -> tuple[Path, Path]:
    """Write a random tiny target (with a byte tokenizer) and a random drafter; return both dirs.

    A random drafter is accepted only by chance: this pair exercises the machinery, not speed.
    """
    from .drafter import Eagle3Drafter

    root = Path(directory)
    tdir, ddir = root / "target", root / "drafter"
    if not (tdir / "config.json").exists():
        model = tiny_target(
            arch,
            seed,
            vocab_size=257,
            eos_token_id=256,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=192,
            num_hidden_layers=8,
        )
        model.save_pretrained(str(tdir))
        byte_tokenizer(tdir)
    if not (ddir / "config.json").exists():
        Eagle3Drafter.for_target(tdir, fc_norm=fc_norm, norm_output=norm_output, seed=seed).save_pretrained(ddir)
    return tdir, ddir
