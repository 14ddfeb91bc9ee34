"""Shared helpers for the runtime tests (tiny random targets and drafters)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

import tritonspec as ts
from tritonspec.runtime.tiny import tiny_target


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate`` (the oracle), without EOS stopping."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def runtime(model, drafter=None, spec=None, **kw) -> ts.SpeculativeRuntime:
    kw.setdefault("max_seq_len", 160)
    kw.setdefault("backend", "torch")
    return ts.SpeculativeRuntime.from_pretrained(model, drafter, spec=spec, **kw)


__all__ = ["hf_greedy", "perm_pair", "random_prompts", "runtime", "tiny_target"]


def perm_pair(
    arch: str = "llama",
    vocab: int = 24,
    seed: int = 0,
    alpha: float = 0.3,
    chain: list[int] | None = None,
    *,
    target_overrides: dict | None = None,
    **flags,
):
    """A target whose greedy next token is mostly ``perm(current token)`` and a drafter built to
    predict exactly ``perm(input token)``: a deliberately good drafter with deep acceptances.

    Target: layer outputs (o_proj, down_proj) scaled by ``alpha`` so the residual stream stays close
    to the token embedding, and ``lm_head[v] = E[perm^-1(v)]``; the layers still perturb the choice,
    so acceptance is high but not total. Drafter: attention that looks at the query token itself
    (large self-similarity scores), values = the normed token embedding, MLP off, residual damped
    (``norm_before_residual`` with a tiny ``hidden_norm``), ``lm_head`` = the target's permuted
    embeddings on the dimensions the attention carries. ``target_overrides`` go to ``tiny_target``
    (smaller sizes for the interpreter-bound Triton-backend tests); ``flags`` to the drafter.
    """
    model = tiny_target(arch, seed=seed, vocab_size=vocab, **(target_overrides or {}))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    if chain:
        rest = [t for t in torch.randperm(vocab, generator=g).tolist() if t not in chain]
        order = list(chain) + rest  # one cycle through chain, then every other token
        perm = torch.empty(vocab, dtype=torch.int64)
        perm[torch.tensor(order)] = torch.tensor(order[1:] + order[:1])
    inv = torch.argsort(perm)
    with torch.no_grad():
        E = model.get_input_embeddings().weight
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(alpha)
            layer.mlp.down_proj.weight.mul_(alpha)
        model.lm_head.weight.copy_(E[inv] * 10)
    d = ts.Eagle3Drafter.for_target(model.config, seed=seed, **flags)
    c = d.config
    c.norm_before_residual = True
    H, hd, hq, hkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    active = hkv * hd
    assert active <= H
    with torch.no_grad():
        a, m = d.midlayer.self_attn, d.midlayer
        for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.mlp.down_proj.weight):
            w.zero_()
        eye = torch.eye(hd)
        for h in range(hq):
            j = h // (hq // hkv)
            a.q_proj.weight[h * hd : (h + 1) * hd, j * hd : (j + 1) * hd] = 20 * eye
        for j in range(hkv):
            a.k_proj.weight[j * hd : (j + 1) * hd, j * hd : (j + 1) * hd] = eye
            a.v_proj.weight[j * hd : (j + 1) * hd, j * hd : (j + 1) * hd] = eye
            a.o_proj.weight[j * hd : (j + 1) * hd, (j * (hq // hkv)) * hd : (j * (hq // hkv) + 1) * hd] = eye
        m.hidden_norm.weight.fill_(1e-3)
        d.lm_head.weight.zero_()
        d.lm_head.weight[:, :active] = E[inv][:, :active]
    return model, d


def perf_module(name: str, as_name: str | None = None) -> ModuleType:
    """``perf/<name>.py`` (a script, not a package module) loaded as a module."""
    path = Path(__file__).resolve().parent.parent / "perf" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(as_name or name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
