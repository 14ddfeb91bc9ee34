"""The target's decode forward as one native operator (``kernels/cpu_target.py``, ``tritonspec_cpu::target_step``):
on drawn shapes (batches, query rows, GQA groups, head dims, ragged prefixes, tree masks, trash slots, attention
bounds, captured boundaries, float32 and weight-only bfloat16 panels, bfloat16 activations on bfloat16 panels
or AMX tiles, Llama, Qwen2's q/k/v biases and Qwen3's
per-head q/k norms, an output bias) it returns the Python forward's hidden
states and aux features and writes its K/V bit for bit; it declines what the Python forward would run
differently (a bias in some layers only, weights not packed, other ops, a traced call, a prompt); bfloat16
activations on bfloat16 panels or AMX tiles run its ATen path with the same bits; and
decoding runs it (counted) with the Python forward's tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonspec.kernels import cpu_drafter, cpu_target
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.metadata import AttentionMetadata
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.target import TargetModel
from tritonspec.runtime.tiny import tiny_target

from _util import random_prompts, runtime

WHY = cl.native_op()
AMX = cl.amx_available() is None  # bfloat16 weights packed into AMX tiles run here
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the native CPU operators did not build here: {WHY}")


def _target(
    heads,
    kv_heads,
    D,
    inter=48,
    arch="llama",
    layers=3,
    seed=0,
    dtype=torch.float32,
    weight_bf16=False,
    layout="panels",
):
    """A tiny random target of these head shapes, its projections packed into panels, or for bfloat16 AMX tiles
    (hidden 96: a multiple of 16 and 32 and of every head count drawn)."""
    hf = tiny_target(
        arch, seed=seed, hidden_size=96, intermediate_size=inter, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=D, num_hidden_layers=layers, vocab_size=80,
    )  # fmt: skip
    t = TargetModel.from_pretrained(hf, dtype=dtype, weight_layout=layout)
    if weight_bf16:  # weight-only bfloat16 panels under float32 activations
        for L in t.layers:
            for name in ("wqkv", "wo", "gate_up", "down"):
                setattr(L, name, cl.weight_only_bf16(cl.unpack(getattr(L, name))))
    return t


def _forward(t: TargetModel, native: bool, tokens, meta, aux: bool, ops=None):
    """One forward on a copy of the caches: (hn, aux, k_cache, v_cache)."""
    k, v = t.k_cache.clone(), t.v_cache.clone()
    saved = t.k_cache, t.v_cache
    t.k_cache, t.v_cache = k, v
    t.native_step = native
    try:
        with torch.inference_mode():
            hn, a = t.forward(ops or TorchOps(), tokens, meta, capture_aux=aux)
    finally:
        t.k_cache, t.v_cache = saved
        t.native_step = True
    return hn, a, k, v


@st.composite
def case(draw):
    heads, kv_heads, D = draw(st.sampled_from([(4, 2, 16), (3, 1, 32), (2, 2, 64), (6, 3, 16), (8, 1, 16), (4, 4, 32)]))
    B = draw(st.integers(1, 4))
    Q = draw(st.integers(1, 9))
    T = draw(st.integers(Q, Q + 3))
    S = draw(st.integers(T + 2, 150))
    return dict(
        heads=heads, kv_heads=kv_heads, D=D, B=B, Q=Q, T=T, S=S,
        prefix=[draw(st.integers(0, S - T - 1)) for _ in range(B)],
        inter=draw(st.sampled_from([32, 48, 80])),
        aux=draw(st.sampled_from([(), (0, 2, 3), (1,), (3, 1)])),
        trash=draw(st.booleans()),
        bound=draw(st.booleans()),
        weight_bf16=draw(st.booleans()),
        arch=draw(st.sampled_from(["llama", "qwen2", "qwen3"])),  # q/k/v biases; per-head q/k norms
        out_bias=draw(st.booleans()),
        # bfloat16 activations: bfloat16 panels, or AMX tiles where this CPU has them (K % 32: inter 32 or 64)
        act=draw(st.sampled_from(["float32", "float32", "bf16-panels"] + (["bf16-amx"] if AMX else []))),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _inputs(c, t: TargetModel):
    g = torch.Generator().manual_seed(c["seed"])
    B, Q, T, S = c["B"], c["Q"], c["T"], c["S"]
    t.allocate_cache(4, S)
    for cache in (t.k_cache, t.v_cache):  # a filled prefix, so attention reads something
        cache.copy_(torch.randn(cache.shape, generator=g))
    lens = torch.tensor(c["prefix"])
    tokens = torch.randint(0, 80, (B, Q), generator=g)
    depth = torch.randint(0, 3, (B, Q), generator=g)
    positions = lens[:, None] + depth
    slots = lens[:, None] + torch.arange(Q)
    if c["trash"]:  # idle rows' tokens go to the trash slot
        slots[torch.rand(B, Q, generator=g) < 0.3] = -1
    mask = torch.rand(B, Q, T, generator=g) < 0.6
    mask[:, :, 0] = True
    kv_len = int(lens.max()) + T if c["bound"] else None
    return tokens, AttentionMetadata(positions, slots, lens, mask, kv_len)


@given(c=case())
@settings(max_examples=40, deadline=None)
def test_target_step_is_the_python_forward(c):
    """Hidden states, aux features and the K/V written: the Python forward's, bit for bit, and the operator ran."""
    bf = c["act"] != "float32"
    t = _target(
        c["heads"], c["kv_heads"], c["D"], 64 if c["act"] == "bf16-amx" else c["inter"], arch=c["arch"],
        seed=c["seed"] % 7, weight_bf16=c["weight_bf16"] and not bf, dtype=torch.bfloat16 if bf else torch.float32,
        layout="amx" if c["act"] == "bf16-amx" else "panels",
    )  # fmt: skip
    if c["act"] == "bf16-amx":
        assert t.layers[0].wqkv.dim() == 4 and t.layers[0].down.dim() == 4  # the tiles, not a fallback
    if c["out_bias"]:  # an output projection bias (no family here has one; the operator takes it)
        g = torch.Generator().manual_seed(c["seed"])
        for L in t.layers:
            L.bo = torch.randn(96, generator=g).to(t.dtype)
    t.set_aux_layer_ids(c["aux"])
    tokens, meta = _inputs(c, t)
    before = cpu_target.calls()
    got = _forward(t, True, tokens, meta, aux=bool(c["aux"]))
    assert cpu_target.calls() == before + 1
    want = _forward(t, False, tokens, meta, aux=bool(c["aux"]))
    assert cpu_target.calls() == before + 1
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) == (not c["aux"])
    if c["aux"]:
        assert got[1].shape == (c["B"], c["Q"], len(c["aux"]) * 96)
        assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def test_the_comparison_is_not_vacuous():
    """Inverse: the operator's output moves with what it reads (a tighter attention bound, another layer's
    norm), so equality above is not two paths that ignore their inputs."""
    c = dict(heads=4, kv_heads=2, D=16, B=2, Q=3, T=3, S=60, prefix=[40, 25], inter=48, aux=(1,), trash=False,
             bound=False, weight_bf16=False, seed=3)  # fmt: skip
    t = _target(4, 2, 16)
    t.set_aux_layer_ids((1,))
    tokens, meta = _inputs(c, t)
    base = _forward(t, True, tokens, meta, aux=True)
    short = AttentionMetadata(meta.positions, meta.slots, meta.prefix_lens, meta.tree_mask, 30)  # hides row 0's end
    cut = _forward(t, True, tokens, short, aux=True)
    assert not torch.equal(base[0][0], cut[0][0]) and torch.equal(base[0][1], cut[0][1])
    t.layers[2].ln1.mul_(2.0)  # after the captured boundary: hn moves, aux does not
    moved = _forward(t, True, tokens, meta, aux=True)
    assert not torch.equal(base[0], moved[0]) and torch.equal(base[1], moved[1])


@pytest.mark.parametrize(
    "why", ["mixed-bias", "bfloat16-nk", "nk", "torch-ops", "prompt", "cache-row", "native_step-off", "traced"]
)
def test_declines_what_the_python_forward_runs_otherwise(why):
    """Each of these runs the Python forward (the operator is not called) and still decodes its values."""
    arch = "qwen2" if why == "mixed-bias" else "llama"
    bf = why == "bfloat16-nk"  # bfloat16 weights as loaded ([N, K], not packed)
    t = _target(4, 2, 16, arch=arch, dtype=torch.bfloat16 if bf else torch.float32, layout="nk" if bf else "panels")
    if why == "mixed-bias":  # a kind of weight in some layers only: the operator takes each kind in all or none
        t.layers[1].bqkv = None
    if why == "nk":
        t = TargetModel.from_pretrained(
            tiny_target(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=80),
            weight_layout="nk",
        )
    c = dict(heads=4, kv_heads=2, D=16, B=2, Q=2, T=2, S=40, prefix=[20, 7], seed=1, trash=False, bound=False)
    tokens, meta = _inputs(c, t)
    ops = TorchOps("torch") if why == "torch-ops" else TorchOps()
    if why == "prompt":
        meta = AttentionMetadata(meta.positions * 0 + torch.arange(2), meta.slots * 0 + torch.arange(2),
                                 meta.prefix_lens * 0, None, 2, prefill=True)  # fmt: skip
    before = cpu_target.calls()
    with torch.inference_mode():
        if why == "traced":
            from torch.fx.experimental.proxy_tensor import make_fx

            make_fx(lambda tok: t.forward(ops, tok, meta, capture_aux=False)[0])(tokens)
        elif why == "cache-row":
            t.forward(ops, tokens, meta, capture_aux=False, cache_row=1)
        else:
            t.native_step = why != "native_step-off"
            try:
                t.forward(ops, tokens, meta, capture_aux=False)
            finally:
                t.native_step = True
    assert cpu_target.calls() == before, why


@pytest.mark.parametrize(
    "temperature, batch, arch", [(0.0, 1, "llama"), (0.0, 3, "llama"), (1.0, 1, "llama"), (1.0, 3, "llama"),
                                 (0.0, 3, "qwen2"), (1.0, 1, "qwen3"), (0.0, 3, "qwen3"), (0.0, 3, "llama-bf16"),
                                 (1.0, 1, "qwen3-bf16")]
)  # fmt: skip
def test_decoding_runs_it_with_the_python_forwards_tokens(tmp_path, temperature, batch, arch):
    """Plain and speculative decoding (greedy, and seeded sampling) through the operator emit the tokens of the
    Python forward, prompt by prompt, and the operator ran the decode forwards: Llama, Qwen2 (q/k/v biases) and
    Qwen3 (per-head q/k norms) targets, in float32 and bfloat16."""
    if not cl.panels_default(torch.float32):
        pytest.skip(
            "this CPU keeps float32 weights [N, K] by default (cpu_linear.panels_default): the operator declines"
        )
    from tritonspec.runtime.tiny import tiny_random_pair

    arch, _, bf16 = arch.partition("-")
    target, drafter = tiny_random_pair(tmp_path, arch=arch)
    prompts = random_prompts(257, [5, 17, 3, 30, 9], seed=batch)
    outs = {}
    for native in (True, False):
        rt = runtime(target, drafter, max_batch_size=batch, dtype=torch.bfloat16 if bf16 else torch.float32)
        rt.target.native_step = native
        for spec in (False, True):
            before = cpu_target.calls()
            out = rt.generate(prompts, max_new_tokens=12, speculative=spec, temperature=temperature, seed=5)
            ran = cpu_target.calls() - before
            assert (ran > 0) == native, (native, spec, ran)
            outs[native, spec] = out.token_ids
    assert outs[True, False] == outs[False, False]
    assert outs[True, True] == outs[False, True]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_deterministic_mode_runs_it_where_every_op_is_its_kernel(tmp_path, monkeypatch, arch):
    """Deterministic mode on the CPU kernels (every probe of the target's forward "kernel", Qwen3's head-wide
    q/k norms included) runs the operator, and the drafter's operators too (counted), and its greedy and seeded
    sampled tokens are those of its Python forward and step; on probed PyTorch ops it does not."""
    if not cl.panels_default(torch.float32):
        pytest.skip(
            "this CPU keeps float32 weights [N, K] by default (cpu_linear.panels_default): the operator declines"
        )
    from tritonspec.runtime.tiny import tiny_random_pair

    target, drafter = tiny_random_pair(tmp_path, arch=arch)
    prompts = random_prompts(257, [7, 19, 4], seed=3)
    ran = []  # the drafter operators that ran (returned a result)
    for name in ("drafter_step", "draft_chain", "catch_up"):
        fn = getattr(cpu_drafter, name)

        def counted(*a, _fn=fn, **kw):
            out = _fn(*a, **kw)
            ran.append(out is not None and out is not False)
            return out

        monkeypatch.setattr(cpu_drafter, name, counted)
    outs = {}
    for native in (True, False):
        rt = runtime(target, drafter, max_batch_size=3, deterministic=True)
        assert rt.ops.native_forward_ops(rt.target) is not None
        assert rt.ops.native_drafter_ops(rt.drafter) is not None
        rt.target.native_step = rt.drafter.native_step = native
        for temperature in (0.0, 1.0):
            before, steps = cpu_target.calls(), len(ran)
            out = rt.generate(prompts, max_new_tokens=10, temperature=temperature, seed=11)
            assert (cpu_target.calls() > before) == native and any(ran[steps:]) == native
            outs[native, temperature] = out.token_ids
    assert outs[True, 0.0] == outs[False, 0.0] and outs[True, 1.0] == outs[False, 1.0]
    # inverse: without the CPU kernels (probed PyTorch ops) the operator would not compute the proxy's bits
    probed = runtime(target, drafter, max_batch_size=3, deterministic=True, cpu_linear="torch")
    assert probed.ops.native_forward_ops(probed.target) is None


def test_strided_token_ids_run_it():
    """A grafted tree's tokens can be a strided view (the prompt-lookup branch): the operator takes them (counted)
    and gives the Python forward's values. Before, such forwards fell back to the Python forward."""
    c = dict(heads=4, kv_heads=2, D=16, B=3, Q=4, T=4, S=50, prefix=[30, 9, 21], seed=5, trash=False, bound=True)
    t = _target(4, 2, 16)
    tokens, meta = _inputs(c, t)
    wide = torch.stack([tokens, tokens.flip(-1)], -1)  # [B, Q, 2]
    strided = wide[..., 0]
    assert not strided.is_contiguous() and torch.equal(strided, tokens)
    before = cpu_target.calls()
    got = _forward(t, True, strided, meta, aux=False)
    assert cpu_target.calls() == before + 1
    want = _forward(t, False, tokens, meta, aux=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
