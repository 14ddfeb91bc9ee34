"""A drafter step as one native operator (``kernels/cpu_drafter.py``, ``tritonspec_cpu::drafter_step``): on
drawn shapes (batches, query rows, GQA groups, head dims, ragged prefixes, tree masks, trash slots, both
EAGLE-3.1 switches and ``norm_before_residual``, float32, bfloat16, and float32 on weight-only bfloat16
panels) it returns the Python step's state and writes its K/V bit for bit; it declines what the Python step
would run differently (weights not in panels, mixed dtypes, a traced call); and a decode runs it (counted)
with the drafts of the Python step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import tritonspec as ts
from tritonspec.kernels import cpu_drafter
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.metadata import AttentionMetadata, KVCache
from tritonspec.runtime.ops import TorchOps

from _util import runtime

WHY = cl.native_op()
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"the native CPU operators did not build here: {WHY}"),
    pytest.mark.skipif(
        WHY is None and torch.float32 not in TorchOps().packs_cpu_weights,
        reason="this CPU's torch backend does not pack drafter weights into panels (cpu_linear.panels_default)",
    ),
]


def _packed(d: ts.Eagle3Drafter) -> None:
    """Pack the drafter; skip where this CPU keeps a projection ``[N, K]`` (``cpu_linear.panels_pay``
    declines it), where the operator must decline (the tests assert it ran)."""
    d.pack_for_cpu()
    if any(d._packed[1][n].dim() != 3 for n in ("qkv", "o", "gate_up", "down")):
        pytest.skip("this CPU keeps the test's small projections [N, K] (cpu_linear.panels_pay): the operator declines")


def _drafter(H, heads, kv_heads, inter, dtype, fc_norm, norm_output, nbr, seed=0):
    cfg = LlamaConfig(
        hidden_size=H, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_hidden_layers=4, vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip
    d = ts.Eagle3Drafter.for_target(cfg, fc_norm=fc_norm, norm_output=norm_output, draft_vocab_size=48, seed=seed)
    d.config = dataclasses.replace(d.config, norm_before_residual=nbr)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:  # norms away from 1, so a norm applied to the wrong tensor shows
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    d.attach_target_embedding(torch.randn(96, H, generator=g))
    d = d.to(dtype)
    d.embed_tokens.weight.data = d.embed_tokens.weight.data.to(dtype)
    return d


@st.composite
def step_case(draw):
    heads, kv_heads, D = draw(st.sampled_from([(4, 2, 16), (3, 1, 32), (2, 2, 64), (6, 3, 16), (8, 1, 16)]))
    B = draw(st.integers(1, 4))
    Q = draw(st.integers(1, 9))
    T = draw(st.integers(Q, Q + 4))
    S = draw(st.integers(T + 2, 120))
    prefix = [draw(st.integers(0, S - T - 1)) for _ in range(B)]
    return dict(
        heads=heads, kv_heads=kv_heads, D=D, B=B, Q=Q, T=T, S=S, prefix=prefix,
        inter=draw(st.sampled_from([32, 48, 80])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        flags=draw(st.sampled_from([(True, True), (False, False), (True, False)])),
        nbr=draw(st.booleans()),
        trash=draw(st.booleans()),
        whole=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        bf16_weights=draw(st.booleans()),  # float32: weight-only bfloat16 panels (cpu_weight_dtype)
    )  # fmt: skip


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, Q, T, S, D = c["B"], c["Q"], c["T"], c["S"], c["D"]
    H = c["heads"] * D
    dt = c["dtype"]
    hidden = torch.randn(B, Q, H, generator=g).to(dt)
    tokens = torch.randint(0, 96, (B, Q), generator=g)
    prefix = torch.tensor(c["prefix"])
    offs = torch.randint(0, T - Q + 1, (B,), generator=g)
    slots = prefix[:, None] + offs[:, None] + torch.arange(Q)  # the rows' own tree slots
    if c["trash"]:
        slots[0, -1] = -1  # an idle row writes nowhere
    positions = prefix[:, None] + torch.arange(Q) + 3
    mask = torch.rand(B, Q, T, generator=g) < 0.5
    mask[torch.arange(B)[:, None], torch.arange(Q), offs[:, None] + torch.arange(Q)] = True  # sees itself
    k = torch.randn(max(B, 2), S, c["kv_heads"], D, generator=g).to(dt)
    v = torch.randn(max(B, 2), S, c["kv_heads"], D, generator=g).to(dt)
    meta = AttentionMetadata(positions, slots, prefix, mask, None if c["whole"] else S - 1)
    return hidden, tokens, meta, KVCache(k, v)


def _run(d, ops, hidden, tokens, meta, cache, native):
    cache = KVCache(cache.k.clone(), cache.v.clone())
    d.native_step = native
    with torch.inference_mode():
        hn, carry = d.step(ops, hidden, tokens, meta, cache)
    return hn, carry, cache.k, cache.v


@settings(max_examples=60, deadline=None)
@given(step_case())
def test_native_step_is_the_python_step_bit_for_bit(c):
    d = _drafter(c["heads"] * c["D"], c["heads"], c["kv_heads"], c["inter"], c["dtype"], *c["flags"], c["nbr"])
    ops = TorchOps()
    if c["bf16_weights"] and c["dtype"] == torch.float32 and cl.available(torch.bfloat16) is None:
        d.cpu_weight_dtype = torch.bfloat16
    _packed(d)
    ran = []
    real, real_default = cpu_drafter.drafter_step, cl.panels_default
    cpu_drafter.drafter_step = lambda *a: ran.append(real(*a)) or ran[-1]
    # both dtypes packed (AVX-512 runtimes pack only float32 drafters by default): the operator runs either
    cl.panels_default = lambda dtype=torch.float32: True
    try:
        args = _inputs(c)
        got = _run(d, ops, *args, native=True)
        assert len(ran) == 1 and ran[0] is not None, "the operator did not run (the comparison would hold vacuously)"
        want = _run(d, ops, *args, native=False)
        assert len(ran) == 1, "native_step=False ran the operator"
    finally:
        cpu_drafter.drafter_step, cl.panels_default = real, real_default
    for name, a, b in zip(("hn", "carry", "k_cache", "v_cache"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


def test_the_comparison_sees_a_wrong_residual_and_a_wrong_slot():
    """Inverse: the operator with ``norm_before_residual`` flipped, or one slot moved, differs from the
    Python step (so the equality above is not vacuous)."""
    c = dict(heads=4, kv_heads=2, D=16, B=2, Q=3, T=5, S=40, prefix=[7, 20], inter=48, dtype=torch.float32,
             flags=(True, True), nbr=False, trash=False, whole=True, seed=3)  # fmt: skip
    d = _drafter(64, 4, 2, 48, torch.float32, True, True, False)
    ops = TorchOps()
    _packed(d)
    hidden, tokens, meta, cache = _inputs(c)
    want = _run(d, ops, hidden, tokens, meta, cache, native=False)
    assert torch.equal(_run(d, ops, hidden, tokens, meta, cache, native=True)[0], want[0])
    d.config = dataclasses.replace(d.config, norm_before_residual=True)
    assert not torch.equal(_run(d, ops, hidden, tokens, meta, cache, native=True)[0], want[0])
    d.config = dataclasses.replace(d.config, norm_before_residual=False)
    moved = dataclasses.replace(meta, slots=meta.slots + (torch.arange(3) == 1))
    got = _run(d, ops, hidden, tokens, moved, cache, native=True)
    assert not torch.equal(got[2], want[2])


def test_declines_what_the_python_step_runs_otherwise():
    """None (the Python step runs): a projection left ``[N, K]``, hidden states of another dtype, a
    traced call; the inverse call with everything in place runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c = dict(heads=4, kv_heads=2, D=16, B=1, Q=2, T=3, S=20, prefix=[5], inter=48, dtype=torch.float32,
             flags=(True, True), nbr=False, trash=False, whole=True, seed=1)  # fmt: skip
    d = _drafter(64, 4, 2, 48, torch.float32, True, True, False)
    _packed(d)
    packed = d._packed[1]
    hidden, tokens, meta, cache = _inputs(c)
    m = d.midlayer
    norms = (m.input_layernorm.weight, m.hidden_norm.weight, m.post_attention_layernorm.weight, d.norm.weight)
    rope = d.rope()

    def call(h=hidden, p=packed):
        layer = cpu_drafter.DrafterLayer(d.embed_tokens.weight, norms, p, rope.cos, rope.sin, 1e-6, 0.25, 4, 2, 16,
                                         False, False)  # fmt: skip
        with torch.inference_mode():
            return cpu_drafter.drafter_step(
                h, tokens, layer, meta.positions, meta.slots, cache.k.clone(), cache.v.clone(), meta.prefix_lens,
                meta.tree_mask, None,
            )  # fmt: skip

    assert call() is not None
    assert call(p={**packed, "o": m.self_attn.o_proj.weight.detach()}) is None
    assert call(h=hidden.to(torch.bfloat16)) is None
    seen = []
    make_fx(lambda h: seen.append(call(h)) or h)(hidden)
    assert seen == [None]


@pytest.mark.parametrize("spec", ["tree+lookup", "chain", "sampled"])
def test_decoding_runs_the_operator_with_the_python_steps_drafts(spec, monkeypatch):
    """A speculative generation on the demo pair (every projection in panels) with the native step
    (counted where it ran) gives the tokens, and the acceptance, of the Python step: the drafts are the
    same (greedy and seeded sampling); the catch-up's multi-row steps run it too."""
    cfg = {
        "tree+lookup": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6, prompt_lookup_num_tokens=4),
        "chain": ts.SpecConfig.chain(3),
        "sampled": ts.SpecConfig.chain(3),
    }[spec]
    rt = runtime(*ts.demo_pair("eagle3.1"), spec=cfg, max_batch_size=4, max_seq_len=256)
    rt.decoder.native_catch_ups = False  # the catch-ups' multi-row steps through this operator (not catch_up's)
    d = rt.decoder.drafter
    if not d.packs_on(rt.decoder.ops):
        pytest.skip("this runtime's drafter does not run packed (dtype or CPU)")
    kw = dict(max_new_tokens=24)
    if spec == "sampled":
        kw.update(temperature=1.0, seed=5)
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n", "def fib(n):\n"]
    calls = []  # (query rows, whether the operator ran)
    real = cpu_drafter.drafter_step

    def counted(*a):
        out = real(*a)
        calls.append((a[0].shape[1], out is not None))
        return out

    monkeypatch.setattr(cpu_drafter, "drafter_step", counted)
    native = rt.generate(prompts, **kw)
    ran = [q for q, ok in calls if ok]
    if not ran and not all(d._packed[1][n].dim() == 3 for n in ("qkv", "o", "gate_up", "down")):
        pytest.skip("this CPU keeps the demo drafter's projections [N, K] (cpu_linear.panels_pay)")
    assert calls and len(ran) == len(calls) and max(ran) > 1, (
        f"the operator ran for every step and multi-row catch-ups: {calls}"
    )
    d.native_step = False
    n = len(calls)
    python = rt.generate(prompts, **kw)
    assert len(calls) == n
    assert native.token_ids == python.token_ids
    assert native.stats.mean_acceptance_length == python.stats.mean_acceptance_length
    assert native.stats.mean_acceptance_length > 1.3


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", ["chain", "chain+lookup"])
def test_native_chain_drafts_the_python_loops_tokens(variant, shape, monkeypatch):
    """A greedy top-1 chain drafted by one native call (``Eagle3Drafter.native_chain``) is the Python loop's
    chain, round by round, for both variants (``norm_output`` off and on) and three rows of ragged prompts
    that finish at different rounds (idle rows write nowhere): the same drafts, so the same tokens and τ.
    Inverse: the operator ran in every round of the first pass and in none of the second."""
    from tritonspec.runtime.decode import Decoder

    cfg = {
        "chain": ts.SpecConfig.chain(5),
        "chain+lookup": ts.SpecConfig(
            num_speculative_tokens=4, top_k=1, num_draft_tokens=5, prompt_lookup_num_tokens=4
        ),
    }[shape]
    rt = runtime(*ts.demo_pair(variant), spec=cfg, max_batch_size=4, max_seq_len=256)
    if not rt.decoder.drafter.packs_on(rt.decoder.ops):
        pytest.skip("this runtime's drafter does not run packed (dtype or CPU)")
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n", "x"]
    stops = ["\n\n", "def ", "return"]  # rows stop at different rounds
    native, python = [], []
    real_native, real_loop = cpu_drafter.draft_chain, Decoder.draft_chain

    def spy_native(*a, **k):
        out = real_native(*a, **k)
        native.append(None if out is None else out.clone())
        return out

    def spy_loop(self, n, pick, **k):
        toks, lps = real_loop(self, n, pick, **k)
        python.append(torch.stack(toks, 1).clone())
        return toks, lps

    monkeypatch.setattr(cpu_drafter, "draft_chain", spy_native)
    monkeypatch.setattr(Decoder, "draft_chain", spy_loop)
    a = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert native and all(x is not None for x in native) and not python  # the operator drafted every chain
    rounds = len(native)
    rt.decoder.native_chains = False
    b = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert len(native) == rounds and len(python) == rounds  # the loop drafted every chain this time
    assert all(torch.equal(x, y) for x, y in zip(native, python))
    assert a.token_ids == b.token_ids and a.stats.mean_acceptance_length == b.stats.mean_acceptance_length
    assert len({len(t) for t in a.token_ids}) > 1  # the rows did finish apart


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_native_sampled_chain_drafts_the_python_loops_tokens_and_log_q(variant, temperature, monkeypatch):
    """A sampled chain (temperature > 0, ``SpecConfig.chain``) drafted by one native call
    (``Eagle3Drafter.native_sampled_chain``) is the Python loop's chain and q, bit for bit, round by round,
    for both variants and three rows of ragged seeded prompts that finish apart: the same tokens and τ. Inverse:
    the operator ran in every round of the first pass and in none of the second; top-p keeps the Python loop."""
    from tritonspec.runtime.decode import Decoder

    rt = runtime(*ts.demo_pair(variant), spec=ts.SpecConfig.chain(3), max_batch_size=4, max_seq_len=256)
    if not rt.decoder.drafter.packs_on(rt.decoder.ops):
        pytest.skip("this runtime's drafter does not run packed (dtype or CPU)")
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n", "x"]
    stops = ["\n\n", "def ", "return"]
    native, python = [], []
    real_native, real_loop = cpu_drafter.draft_chain_sampled, Decoder.draft_chain

    def spy_native(*a, **k):
        out = real_native(*a, **k)
        native.append(None if out is None else tuple(t.clone() for t in out))
        return out

    def spy_loop(self, n, pick, **k):
        toks, lps = real_loop(self, n, pick, **k)
        lq = torch.stack(lps, 1)  # q as _draft_sampled_chain places it in the target's vocabulary
        q = torch.zeros(*lq.shape[:2], self.target.vocab_size).index_add_(2, self.d2t, lq.exp())
        python.append((torch.stack(toks, 1).clone(), q))
        return toks, lps

    monkeypatch.setattr(cpu_drafter, "draft_chain_sampled", spy_native)
    monkeypatch.setattr(Decoder, "draft_chain", spy_loop)
    kw = dict(max_new_tokens=30, stop=stops, temperature=temperature, seed=[3, 4, 5])
    a = rt.generate(prompts, **kw)
    assert native and all(x is not None for x in native) and not python  # the operator drafted every chain
    rounds = len(native)
    rt.decoder.native_chains = False
    b = rt.generate(prompts, **kw)
    assert len(native) == rounds and len(python) == rounds  # the loop drafted every chain this time
    for (tn, qn), (tp, qp) in zip(native, python):
        assert torch.equal(tn, tp) and torch.equal(qn, qp) and qn.shape[-1] == rt.decoder.target.vocab_size
    assert a.token_ids == b.token_ids and a.stats.mean_acceptance_length == b.stats.mean_acceptance_length
    assert len({len(t) for t in a.token_ids}) > 1  # the rows did finish apart
    rt.decoder.native_chains = True
    rt.generate(prompts[:1], max_new_tokens=6, temperature=temperature, top_p=0.9, seed=1)
    assert len(native) == rounds  # top-p: the Python loop


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("spec", ["chain+lookup", "tree"])
def test_native_catch_up_is_the_python_catch_up(variant, spec, monkeypatch):
    """A decode round's catch-up as one native call (``Decoder._native_catch_up``) leaves the drafter's state
    (hn, carry) and its K/V cache as the Python catch-up does, bit for bit, round after round: both variants
    (fc_norm and norm_output off and on), a chain with a lookup branch and a top-2 tree, three ragged rows that
    finish apart (idle rows re-encode nothing). Inverse: the operator ran in every round of the first pass and
    in none of the second, and a state shifted by one position is seen."""
    from tritonspec.runtime.decode import Decoder

    cfg = {
        "chain+lookup": ts.SpecConfig(
            num_speculative_tokens=4, top_k=1, num_draft_tokens=5, prompt_lookup_num_tokens=4
        ),
        "tree": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6),
    }[spec]
    rt = runtime(*ts.demo_pair(variant), spec=cfg, max_batch_size=4, max_seq_len=256)
    if not rt.decoder.drafter.packs_on(rt.decoder.ops):
        pytest.skip("this runtime's drafter does not run packed (dtype or CPU)")
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n", "x"]
    stops = ["\n\n", "def ", "return"]
    states: dict[bool, list[tuple[torch.Tensor, ...]]] = {True: [], False: []}
    ran: list[bool] = []
    real_commit, real_native = Decoder.commit, Decoder._native_catch_up

    def spy_commit(self, tree, v, **k):
        real_commit(self, tree, v, **k)
        B = tree.tokens.shape[0]
        cache = self.draft_cache  # each row's committed slots (past them: stale drafts, never read)
        kv = [c[b, : int(self.L[b])].clone() for b in range(B) for c in (cache.k, cache.v)]
        states[self.native_catch_ups].append((self.bufs.hn[:B].clone(), self.bufs.carry[:B].clone(), *kv))

    def spy_native(self, *a):
        out = real_native(self, *a)
        ran.append(out)
        return out

    monkeypatch.setattr(Decoder, "commit", spy_commit)
    monkeypatch.setattr(Decoder, "_native_catch_up", spy_native)
    a = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert ran and all(ran)
    rt.decoder.native_catch_ups = False
    b = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert not any(ran[len(states[True]) :])
    assert len(states[True]) == len(states[False]) > 3
    for x, y in zip(states[True], states[False]):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    assert a.token_ids == b.token_ids and len({len(t) for t in a.token_ids}) > 1
    hn0, hn1 = states[True][1][0], states[False][2][0]
    assert not torch.equal(hn0, hn1)  # the comparison sees another round's state


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", [(3, 2, 7, 4), (4, 3, 9, 0), (1, 2, 3, 0)])
def test_native_tree_is_the_python_expansion(variant, shape, monkeypatch):
    """A greedy top-k > 1 tree drafted by one native call (``Eagle3Drafter.native_tree``) is the Python
    expansion's tree round by round (tokens, parents, depths, mask), for both variants, trees of top-k 2 and 3
    (with and without the lookup branch, depth 1 too) and three ragged rows that finish apart. Inverse: the
    operator built every tree of the first pass and none of the second, and the trees differ between rounds."""
    from tritonspec.runtime.decode import Decoder

    D, K, N, lookup = shape
    cfg = ts.SpecConfig(num_speculative_tokens=D, top_k=K, num_draft_tokens=N, prompt_lookup_num_tokens=lookup)
    rt = runtime(*ts.demo_pair(variant), spec=cfg, max_batch_size=4, max_seq_len=256)
    if not rt.decoder.drafter.packs_on(rt.decoder.ops):
        pytest.skip("this runtime's drafter does not run packed (dtype or CPU)")
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n", "x"]
    stops = ["\n\n", "def ", "return"]
    trees: dict[bool, list[tuple[torch.Tensor, ...]]] = {True: [], False: []}
    built: list[bool] = []
    real_graft, real_native = Decoder._graft_lookup, cpu_drafter.draft_tree

    def spy_graft(self, spec, node_tokens, par, depth, mask, *a):
        trees[self.native_chains].append(tuple(t.clone() for t in (node_tokens, par, depth, mask)))
        return real_graft(self, spec, node_tokens, par, depth, mask, *a)

    def spy_native(*a, **k):
        out = real_native(*a, **k)
        built.append(out is not None)
        return out

    monkeypatch.setattr(Decoder, "_graft_lookup", spy_graft)
    monkeypatch.setattr(cpu_drafter, "draft_tree", spy_native)
    a = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert built and all(built) and len(built) == len(trees[True])
    rt.decoder.native_chains = False
    b = rt.generate(prompts, max_new_tokens=30, stop=stops)
    assert len(built) == len(trees[True]) == len(trees[False]) > 3
    for x, y in zip(trees[True], trees[False]):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    assert a.token_ids == b.token_ids and a.stats.mean_acceptance_length == b.stats.mean_acceptance_length
    assert len({len(t) for t in a.token_ids}) > 1
    assert not torch.equal(trees[True][0][0], trees[True][1][0])


@pytest.mark.parametrize("adaptive", [True, False])
def test_commit_history_is_the_pytorch_bookkeeping(adaptive, monkeypatch):
    """``commit``'s token history and drafted count as one C call (``Decoder._commit_history``) write what its
    PyTorch ops write, round by round: the history up to each row's root and, under adaptive shapes, the drafted
    count column; three ragged rows that finish apart. Inverse: the operator ran in every round of the first pass
    and none of the second, and the drafted counts take more than one value."""
    from tritonspec.runtime.decode import Decoder

    kw = dict(adaptive_shape=True) if adaptive else dict(spec=ts.SpecConfig.chain(4))
    rt = runtime(*ts.demo_pair("eagle3.1"), max_batch_size=4, max_seq_len=256, **kw)
    prompts = ["import os\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n", "x"]
    stops = ["\n\n", "def ", "return"]
    seen: dict[bool, list[tuple]] = {True: [], False: []}
    ran: list[bool] = []
    real_commit, real_hist = Decoder.commit, Decoder._commit_history

    def spy_commit(self, tree, v, **k):
        real_commit(self, tree, v, **k)
        if self.speculative:
            rows = [self.bufs.hist[b, : int(self.L[b]) + 1].clone() for b in range(tree.tokens.shape[0])]
            seen[self.native_history].append((*rows, self.out[:, -1].clone() if self.track_drafted else None))

    def spy_hist(self, v):
        out = real_hist(self, v)
        ran.append(out)
        return out

    monkeypatch.setattr(Decoder, "commit", spy_commit)
    monkeypatch.setattr(Decoder, "_commit_history", spy_hist)

    def run() -> list[list[int]]:  # adaptive shapes are per request at batch 1: the prompts one by one
        if adaptive:
            return [rt.generate(p, max_new_tokens=30, stop=stops).token_ids for p in prompts]
        return rt.generate(prompts, max_new_tokens=30, stop=stops).token_ids

    a = run()
    assert ran and all(ran) and any(x[-1] is not None for x in seen[True]) == adaptive  # counted under adaptive
    rt.decoder.native_history = False
    b = run()
    assert not any(ran[len(seen[True]) :]) and len(seen[True]) == len(seen[False]) > 3
    for x, y in zip(seen[True], seen[False]):
        assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(x, y))
    assert a == b and (adaptive or len({len(t) for t in a}) > 1)
    if adaptive:
        assert len({int(c) for x in seen[True] if x[-1] is not None for c in x[-1]}) > 1
