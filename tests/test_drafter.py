"""Drafter equations (EAGLE-3 vs 3.1 switches), checkpoint formats and validation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.runtime.metadata import AttentionMetadata, KVCache
from tritonspec.runtime.ops import TorchOps

from _util import runtime, tiny_target

OPS = TorchOps()


def rms(x, w, eps):
    x64 = x.double()
    return (w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).float()


def drafter(fc_norm=False, norm_output=False, seed=0, **kw):
    cfg = tiny_target("llama", seed=0).config
    d = ts.Eagle3Drafter.for_target(cfg, fc_norm=fc_norm, norm_output=norm_output, seed=seed, **kw)
    with torch.no_grad():  # non-trivial norm weights so that a norm mix-up shows
        for name, p in d.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    d.attach_target_embedding(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(9)))
    return d


def one_step(d, hidden, tokens):
    """Run ``step`` on a single causal chunk (prefix 0) with a fresh cache."""
    c = d.config
    B, Q, _ = hidden.shape
    k = torch.zeros(B, Q + 1, c.num_key_value_heads, c.head_dim)
    v = torch.zeros_like(k)
    pos = torch.arange(Q).expand(B, Q)
    meta = AttentionMetadata(
        pos, pos, torch.zeros(B, dtype=torch.int64), torch.ones(Q, Q, dtype=torch.bool).tril().expand(B, Q, Q), Q
    )
    return d.step(OPS, hidden, tokens, meta, KVCache(k, v))


def eagle3_by_hand(d, u, y):
    """EAGLE-3's equations written out independently (eagle-spec §2.2), float64 norms."""
    c, m = d.config, d.midlayer
    eps = c.rms_norm_eps
    e = rms(d.embed_tokens.weight[y], m.input_layernorm.weight, eps)
    v = rms(u, m.hidden_norm.weight, eps)
    z = torch.cat([e, v], -1)
    B, Q, _ = u.shape
    q = (z @ m.self_attn.q_proj.weight.T).view(B, Q, c.num_attention_heads, c.head_dim).transpose(1, 2)
    k = (z @ m.self_attn.k_proj.weight.T).view(B, Q, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    val = (z @ m.self_attn.v_proj.weight.T).view(B, Q, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    rope = d.rope()
    pos = torch.arange(Q)
    cos, sin = rope.cos[pos], rope.sin[pos]
    rot = lambda x: torch.cat([-x[..., c.head_dim // 2 :], x[..., : c.head_dim // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    rep = c.num_attention_heads // c.num_key_value_heads
    a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1), is_causal=True)
    r = u + a.transpose(1, 2).reshape(B, Q, -1) @ m.self_attn.o_proj.weight.T
    x = rms(r, m.post_attention_layernorm.weight, eps)
    h = r + (F.silu(x @ m.mlp.gate_proj.weight.T) * (x @ m.mlp.up_proj.weight.T)) @ m.mlp.down_proj.weight.T
    return rms(h, d.norm.weight, eps), h


@torch.no_grad()
def test_flags_off_is_eagle3():
    d = drafter()
    u = torch.randn(2, 5, d.config.hidden_size)
    y = torch.randint(0, d.config.vocab_size, (2, 5))
    hn, carry = one_step(d, u, y)
    hn_ref, h_ref = eagle3_by_hand(d, u, y)
    torch.testing.assert_close(hn, hn_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(carry, h_ref, atol=1e-4, rtol=1e-4)  # EAGLE-3 carries the pre-norm h
    aux = torch.randn(4, 3 * d.config.target_hidden_size)
    torch.testing.assert_close(d.combine(OPS, aux, torch.arange(4)), aux @ d.fc.weight.T)  # plain fc


@torch.no_grad()
def test_fc_norm_normalises_each_chunk_separately():
    d = drafter(fc_norm=True)
    H = d.config.target_hidden_size
    aux = torch.randn(6, 3 * H) * torch.tensor([1.0] * H + [10.0] * H + [100.0] * H)  # deep layers are larger
    got = d.combine(OPS, aux, torch.arange(6))
    chunks = [rms(aux[:, i * H : (i + 1) * H], d.fc_norm[i].weight, d.config.rms_norm_eps) for i in range(3)]
    torch.testing.assert_close(got, torch.cat(chunks, -1) @ d.fc.weight.T, atol=1e-4, rtol=1e-4)
    w_all = torch.cat([d.fc_norm[i].weight for i in range(3)])
    one_norm = rms(aux, w_all, d.config.rms_norm_eps) @ d.fc.weight.T
    assert (got - one_norm).abs().max() > 1e-2  # inverse: one norm over the concat is a different function
    pad = d.combine(OPS, aux, torch.tensor([2, -1]))
    assert torch.equal(pad[1], torch.zeros_like(pad[1])) and torch.allclose(pad[0], got[2])


@torch.no_grad()
def test_norm_output_changes_carry_never_logits():
    d3, d31 = drafter(norm_output=False), drafter(norm_output=True)
    d31.load_state_dict(d3.state_dict())
    d31.attach_target_embedding(d3.embed_tokens.weight)
    u = torch.randn(1, 4, d3.config.hidden_size)
    y = torch.randint(0, d3.config.vocab_size, (1, 4))
    hn3, c3 = one_step(d3, u, y)
    hn31, c31 = one_step(d31, u, y)
    assert torch.equal(hn3, hn31) and torch.equal(d3.logits(hn3), d31.logits(hn31))
    assert torch.equal(c31, hn31) and not torch.allclose(c3, c31)
    rms_c31 = c31.pow(2).mean(-1).sqrt() / d31.norm.weight.abs().mean()
    assert rms_c31.max() < 3.0  # the post-norm carry is bounded


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("flags", [(False, False), (True, True), (True, False)])
def test_save_load_round_trip_bit_for_bit(tmp_path, fmt, flags):
    d = drafter(*flags, draft_vocab_size=40)
    d.set_draft_vocab(torch.randperm(97, generator=torch.Generator().manual_seed(1))[:40])
    d.config.aux_layer_ids = (1, 3, 4)  # first id 1: must still read back as a boundary id
    d.save_pretrained(tmp_path, format=fmt)
    e = ts.Eagle3Drafter.from_pretrained(tmp_path)
    assert e.config == d.config
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: top level, boundary ids
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: post-layer, +1
        assert (cfg["fc_norm"], cfg["norm_output"]) == flags
    else:
        assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["hidden_size"] == 72


def _write_official(tmp_path, d, ids=None, prefix=""):
    """An official-format checkpoint: LlamaForCausalLM config, flat midlayer.* tensors, pytorch_model.bin."""
    c = d.config
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
    }
    if ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.save({prefix + k: v for k, v in d.state_dict().items() if k != "t2d"}, tmp_path / "pytorch_model.bin")


def test_official_flat_format_and_post_layer_ids(tmp_path):
    d = drafter()
    _write_official(tmp_path, d, ids=[1, 2, 3], prefix="model.")
    with pytest.warns(UserWarning, match="post-layer"):
        e = ts.Eagle3Drafter.from_pretrained(tmp_path)
    assert e.config.aux_layer_ids == (2, 3, 4)  # SpecForge post-layer ids -> boundary ids
    assert all(torch.equal(d.state_dict()[k], e.state_dict()[k]) for k in d.state_dict())
    assert ts.Eagle3Drafter.from_pretrained(tmp_path, aux_layer_convention="boundary").config.aux_layer_ids == (1, 2, 3)
    _write_official(tmp_path, d, ids=None)
    assert ts.Eagle3Drafter.from_pretrained(tmp_path).config.aux_layer_ids is None  # resolved against the target


def test_exporter_validates(tmp_path):
    d = drafter()
    d.config.max_position_embeddings = 64
    with pytest.raises(ValueError, match="max_position_embeddings=64 is below the target's 512"):
        d.save_pretrained(tmp_path)
    d = drafter()
    d.config.aux_layer_ids = None
    with pytest.raises(ValueError, match="aux_layer_ids"):
        d.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="format"):
        drafter().save_pretrained(tmp_path, format="gguf")
    with pytest.raises(ValueError, match="draft_vocab_size=200 is larger than the target vocabulary 97"):
        drafter(draft_vocab_size=200)


def test_incompatible_drafter_names_both_values():
    target = tiny_target("llama", seed=0)
    other = tiny_target("llama", seed=0, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="target_hidden_size=48 does not match the target's hidden_size=72"):
        runtime(target, ts.Eagle3Drafter.for_target(other.config))
    with pytest.raises(ValueError, match="vocab_size=50 does not match the target's vocab_size=97"):
        runtime(target, ts.Eagle3Drafter.for_target(tiny_target("llama", seed=0, vocab_size=50).config))
    with pytest.raises(ValueError, match=r"aux layer ids \[2, 3, 9\] out of range .* 6 layers"):
        runtime(target, ts.Eagle3Drafter.for_target(target.config, aux_layer_ids=(2, 3, 9)))


def test_corrupt_drafter_file_is_named(tmp_path):
    drafter().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="corrupt weight file .*model.safetensors"):
        ts.Eagle3Drafter.from_pretrained(tmp_path)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 37), min_size=1, max_size=3),
    flags=st.sampled_from([(False, False), (True, True)]),
    nbr=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prompt_step_keeps_one_row_and_writes_every_kv(lens, flags, nbr, seed):
    """``step(..., keep=)`` on a prompt (a catch-up's prefill): the kept row's ``(hn, carry)`` are the full
    forward's row (a different attention kernel: float32 tolerance) and the cache holds every row's K/V,
    bit for bit; the inverse: keeping another row gives that row, which differs from the last."""
    import dataclasses

    d = drafter(*flags, seed=seed % 7)
    d.config = dataclasses.replace(d.config, norm_before_residual=nbr)
    c, B, P = d.config, len(lens), max(lens)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, P, c.hidden_size, generator=g)
    tokens = torch.randint(0, c.vocab_size, (B, P), generator=g)
    n = torch.tensor(lens)
    ar = torch.arange(P)
    pos = ar.expand(B, P)
    meta = AttentionMetadata(
        pos, torch.where(ar < n[:, None], pos, -1), torch.zeros(B, dtype=torch.int64),
        torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P), P, prefill=True,
    )  # fmt: skip

    def run(keep):
        cache = KVCache(
            torch.zeros(B + 1, P + 1, c.num_key_value_heads, c.head_dim),
            torch.zeros(B + 1, P + 1, c.num_key_value_heads, c.head_dim),
        )
        with torch.inference_mode():
            hn, carry = d.step(OPS, hidden, tokens, meta, cache, keep=keep)
        return hn, carry, cache

    hn, carry, full = run(None)
    last = n - 1
    for keep in (last, (n - 2).clamp(min=0)):
        khn, kcarry, kc = run(keep)
        assert khn.shape == kcarry.shape == (B, 1, c.hidden_size)
        assert torch.equal(kc.k, full.k) and torch.equal(kc.v, full.v)
        rows = torch.arange(B)
        torch.testing.assert_close(khn[:, 0], hn[rows, keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kcarry[:, 0], carry[rows, keep], rtol=1e-5, atol=1e-5)
    if max(lens) >= 2:  # the inverse: the row kept matters
        b = max(range(B), key=lambda i: lens[i])
        assert not torch.allclose(hn[b, lens[b] - 1], hn[b, lens[b] - 2], atol=1e-3)
    cache = run(None)[2]
    before = cache.k.clone()
    for bad_meta, bad_keep in (
        (dataclasses.replace(meta, prefill=False), last),
        (meta, last.int()),
        (meta, last[:1, None]),
    ):
        with pytest.raises(ValueError, match="keep= selects one row"):
            d.step(OPS, hidden, tokens, bad_meta, cache, keep=bad_keep)
    assert torch.equal(cache.k, before), "a refused call wrote the cache"


def test_catch_up_of_a_prompt_runs_one_row_beyond_the_kv(monkeypatch):
    """The decoder's prompt catch-up asks the drafter for the last row only (counted), and speculative
    greedy output still equals plain decoding's; an observed run (drift) keeps the whole forward."""
    target = tiny_target("llama", seed=0)
    d = drafter(True, True, seed=1)
    seen = []
    real = ts.Eagle3Drafter.step

    def spy(self, ops, hidden, tokens, meta, cache, keep=None):
        seen.append((meta.prefill, None if keep is None else keep.tolist(), hidden.shape[1]))
        return real(self, ops, hidden, tokens, meta, cache, keep)

    monkeypatch.setattr(ts.Eagle3Drafter, "step", spy)
    rt = runtime(target, d, spec=ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6))
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6]]
    spec = rt.generate(prompts, max_new_tokens=12)
    plain = rt.generate(prompts, max_new_tokens=12, speculative=False)
    assert spec.token_ids == plain.token_ids
    prompt_steps = [s for s in seen if s[0]]
    assert prompt_steps and all(keep is not None for _, keep, _ in prompt_steps)
    assert sorted(k for _, keep, _ in prompt_steps for k in keep) == [2, 6]  # each prompt's last position
    from tritonspec.runtime.drift import DriftRecorder

    seen.clear()
    with rt.observe(DriftRecorder(3)):  # the observer records every query's attention: the whole forward
        observed = rt.generate([prompts[0]], max_new_tokens=12)
    assert observed.token_ids[0] == plain.token_ids[0]
    assert [keep for prefill, keep, _ in seen if prefill] == [None]


def test_stacked_fc_norm_weights_follow_every_change():
    """``fc_norm_weight`` keeps its stack between rounds only while the weights are unchanged: an in-place
    update, a loaded state dict or a replaced parameter shows at once; with autograd on it is a fresh stack
    that carries gradients to each norm."""
    d = ts.Eagle3Drafter.from_pretrained(ts.demo_pair("eagle3.1")[1])
    with torch.no_grad():
        a = d.fc_norm_weight().clone()
        assert d.fc_norm_weight() is d.fc_norm_weight()  # kept
        d.fc_norm[1].weight.add_(1.0)
        assert torch.equal(d.fc_norm_weight()[1], a[1] + 1) and torch.equal(d.fc_norm_weight()[0], a[0])
        d.load_state_dict({k: v * 0 if k.startswith("fc_norm.2") else v for k, v in d.state_dict().items()})
        assert not d.fc_norm_weight()[2].any()
        d.fc_norm[0].weight = torch.nn.Parameter(torch.full_like(a[0], 3.0))
        assert d.fc_norm_weight()[0].eq(3.0).all()
    w = d.fc_norm_weight()
    w.sum().backward()
    assert all(n.weight.grad is not None and n.weight.grad.eq(1).all() for n in d.fc_norm)
