"""``kernels.det_attention``: deterministic mode's attention on a GPU (run here under the interpreter).

Stated tolerances (inputs ~ N(0, 1)): within ``ATOL[dtype]`` of float64 attention over the query's
root-to-node path (``test_kernels_tree_attention``'s property and tolerances). Invariance, bit for
bit, the reason the kernel exists: a tree node's output equals the output of the same query decoded
alone after its ancestors were moved into the prefix (another cache row, another cache length,
another ``kv_len``), and equals the same query as the last token of a causal prompt; nothing depends
on the batch, the other queries or the tree's width. Splits (shrunk here to 64 positions) change
none of it. The inverse: the default mode's ``kernels.tree_attention``, batch-invariant too, gives a
tree node other bits than its decode step for some case (so the property is not vacuous). End to
end, deterministic mode in the GPU's whole configuration (the Triton backend, the batch-invariant
matmul, Triton RMSNorm, this attention; under the interpreter on a CPU): speculative greedy tokens
and logits equal plain decoding's bit for bit, and a prompt alone equals it batched.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from test_kernels_tree_attention import ancestors, attention64, random_parents  # noqa: E402

import tritonspec as ts  # noqa: E402
from tritonspec.kernels import det_attention as da  # noqa: E402
from tritonspec.kernels.tree_attention import tree_attention  # noqa: E402

from _util import perm_pair, random_prompts, runtime  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEADS = [(1, 1), (4, 2), (6, 3), (4, 1)]  # (Hq, Hkv)


@pytest.fixture
def small_split(monkeypatch):
    """Splits of 64 positions, so that short sequences cross split boundaries."""
    monkeypatch.setattr(da, "SPLIT", 64)


def _mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        m[i, ancestors(parents, i)] = True
    return m


def _tree(batch, n, hq, hkv, d, dtype, prefix, shape, seed, extra_slots=3):
    g = torch.Generator().manual_seed(seed)
    S = max(prefix) + n + extra_slots
    q = torch.randn(batch, n, hq, d, generator=g).to(dtype).to(DEVICE)
    kc = torch.randn(batch, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(batch, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    parents = [random_parents(shape, n, g) for _ in range(batch)]
    mask = torch.stack([_mask(p) for p in parents]).to(DEVICE)
    return q, kc, vc, torch.tensor(prefix, dtype=torch.int64, device=DEVICE), mask, parents


@st.composite
def tree_case(draw):
    batch = draw(st.integers(1, 3))
    n = draw(st.sampled_from([1, 2, 5, 7]))
    hq, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([12, 16, 40]))
    dtype = draw(st.sampled_from(DTYPES))
    prefix = draw(st.lists(st.sampled_from([0, 1, 60, 63, 64, 65, 100]), min_size=batch, max_size=batch))
    shape = draw(st.sampled_from(["random", "chain", "siblings", "padding"]))
    return batch, n, hq, hkv, d, dtype, prefix, shape, draw(st.integers(0, 2**16))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree_case())  # small_split is set once for every example (it holds for all of them)
def test_equals_attention_over_the_path_and_each_node_equals_its_decode_step(small_split, case):
    batch, n, hq, hkv, d, dtype, prefix, shape, seed = case
    q, kc, vc, pl, mask, parents = _tree(*case)
    scale = d**-0.5
    out = da.det_tree_attention(q, kc, vc, pl, mask, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    # the kv_len hint (as long as it covers the tree) and the other rows change no bit
    assert torch.equal(out, da.det_tree_attention(q, kc, vc, pl, mask, scale, max(prefix) + n))
    assert torch.equal(out[-1:], da.det_tree_attention(q[-1:], kc[-1:], vc[-1:], pl[-1:], mask[-1:], scale))
    g = torch.Generator().manual_seed(seed + 1)
    for b in range(batch):
        P = prefix[b]
        for i in range(n):
            path = ancestors(parents[b], i)
            checked = i in (n - 1, n // 2)  # each node against float64, two per row as a decode step too
            slots = list(range(P)) + [P + t for t in path]
            want = attention64(q[b, i], kc[b, slots], vc[b, slots], scale)
            assert (out[b, i].double() - want).abs().max().item() <= ATOL[dtype], (b, i)
            if not checked:
                continue
            # decoded alone after its ancestors were committed: a contiguous prefix in another row of a
            # longer cache, garbage around it, another kv_len
            m = len(slots)
            k2 = torch.randn(2, m + 9, hkv, d, generator=g).to(dtype).to(DEVICE)
            v2 = torch.randn(2, m + 9, hkv, d, generator=g).to(dtype).to(DEVICE)
            k2[1, :m], v2[1, :m] = kc[b, slots], vc[b, slots]
            q2 = torch.randn(2, 1, hq, d, generator=g).to(dtype).to(DEVICE)
            q2[1, 0] = q[b, i]
            one = torch.ones(2, 1, 1, dtype=torch.bool, device=DEVICE)
            dec = da.det_tree_attention(q2, k2, v2, torch.tensor([3, m - 1], device=DEVICE), one, scale, m + 4)
            assert torch.equal(dec[1, 0], out[b, i]), (b, i)
            if b == 0 and i == n - 1:  # and as a prompt's last token
                qp = torch.randn(1, m, hq, d, generator=g).to(dtype).to(DEVICE)
                qp[0, -1] = q[b, i]
                pr = da.det_causal_attention(qp, kc[b : b + 1, slots], vc[b : b + 1, slots], scale)
                assert torch.equal(pr[0, -1], out[b, i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,offset", [(1, 0), (7, 0), (70, 0), (9, 90)])
def test_causal_equals_causal_attention_and_its_decode_steps(small_split, dtype, P, offset):
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(P + offset)
    n, B = offset + P, 2 if P < 20 else 1  # (the interpreter runs a program per query, head and split)
    q = torch.randn(B, P, hq, d, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, n + 5, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, n + 5, hkv, d, generator=g).to(dtype).to(DEVICE)
    out = da.det_causal_attention(q, k, v, d**-0.5, q_offset=offset)
    for b in range(B):
        for i in sorted({0, P // 2, P - 1}):
            pos = offset + i
            want = attention64(q[b, i], k[b, : pos + 1], v[b, : pos + 1], d**-0.5)
            assert (out[b, i].double() - want).abs().max().item() <= ATOL[dtype]
            one = torch.ones(1, 1, 1, dtype=torch.bool, device=DEVICE)
            pl = torch.tensor([pos], device=DEVICE)
            dec = da.det_tree_attention(q[b : b + 1, i : i + 1], k[b : b + 1], v[b : b + 1], pl, one, d**-0.5)
            assert torch.equal(dec[0, 0], out[b, i])
    assert torch.equal(out[-1:], da.det_causal_attention(q[-1:], k[-1:], v[-1:], d**-0.5, q_offset=offset))


def test_default_tree_attention_differs_between_tree_and_decode_layout():
    """The inverse: ``kernels.tree_attention`` reduces the tree region apart from the prefix (a split of
    its own, merged last), so for some node the bits differ from its decode step after the commit;
    ``det_tree_attention`` gives the same bits in every case tried."""
    hq, hkv, d, n = 4, 2, 32, 6
    parents = [-1, 0, 1, 2, 3, 4]  # a chain: node i's path is 0..i
    mask = _mask(parents)[None]
    differ = 0
    mask = mask.to(DEVICE)
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        P = 70
        q = torch.randn(1, n, hq, d, generator=g).to(DEVICE)
        kc, vc = (
            torch.randn(1, P + n, hkv, d, generator=g).to(DEVICE),
            torch.randn(1, P + n, hkv, d, generator=g).to(DEVICE),
        )
        pl = torch.tensor([P], device=DEVICE)
        for fn in (tree_attention, da.det_tree_attention):
            out = fn(q, kc, vc, pl, mask, d**-0.5)
            one = torch.ones(1, 1, 1, dtype=torch.bool, device=DEVICE)
            dec = fn(q[:, n - 1 :], kc, vc, torch.tensor([P + n - 1], device=DEVICE), one, d**-0.5)
            same = torch.equal(dec[0, 0], out[0, n - 1])
            if fn is da.det_tree_attention:
                assert same, seed
            else:
                differ += not same
    if DEVICE == "cuda" and not differ:  # as tests/test_deterministic_gpu.py does for cuBLAS
        pytest.skip("this GPU's default tree attention gave every node its decode step's bits in 12 cases")
    assert differ > 0


def test_causal_queries_in_chunks_give_the_same_bits(small_split, monkeypatch):
    """A prompt's queries run in chunks when their fp32 partials would pass ``PARTIALS_BYTES`` (a 32K prompt
    of an 8B model needed 8.6 GB a layer in one call): every query is its own program, so no bit changes."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 150, 4, 16, generator=g).to(DEVICE)
    k, v = torch.randn(2, 160, 2, 16, generator=g).to(DEVICE), torch.randn(2, 160, 2, 16, generator=g).to(DEVICE)
    whole = da.det_causal_attention(q, k, v, 0.25, q_offset=7)
    monkeypatch.setattr(da, "PARTIALS_BYTES", 2 * 4 * 18 * 4 * 3 * 50)  # 50 queries a chunk
    launch, chunks = da._launch, []
    monkeypatch.setattr(da, "_launch", lambda q, *a: chunks.append(q.shape[1]) or launch(q, *a))
    assert torch.equal(da.det_causal_attention(q, k, v, 0.25, q_offset=7), whole)
    assert chunks == [50, 50, 50]  # (the property is not vacuous: the queries did run in chunks)


def test_no_visible_key_gives_zeros_and_tree_slots_past_kv_len_are_not_read():
    q = torch.randn(1, 2, 2, 16, device=DEVICE)
    kc, vc = torch.randn(1, 10, 1, 16, device=DEVICE), torch.randn(1, 10, 1, 16, device=DEVICE)
    mask = torch.tensor([[[False, False], [True, True]]], device=DEVICE)
    pl = torch.tensor([0], device=DEVICE)
    out = da.det_tree_attention(q, kc, vc, pl, mask, 0.25)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    ref = da.det_attention_reference(q, kc, vc, pl, mask, 0.25)
    assert torch.allclose(out, ref, atol=1e-5)
    pl = torch.tensor([5], device=DEVICE)  # tree slots 5 and 6; kv_len 6 hides slot 6, as in the reference
    out = da.det_tree_attention(q, kc, vc, pl, mask, 0.25, kv_len=6)
    assert torch.allclose(out, da.det_attention_reference(q, kc, vc, pl, mask, 0.25, kv_len=6), atol=1e-5)


def test_rejects_bad_arguments():
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    kc = torch.randn(1, 8, 2, 16, device=DEVICE)
    pl, mask = torch.tensor([3], device=DEVICE), torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        da.det_tree_attention(q, kc.half(), kc.half(), pl, mask, 0.25)
    with pytest.raises(ValueError, match="multiple of the cache.s KV heads"):
        da.det_tree_attention(torch.randn(1, 2, 3, 16, device=DEVICE), kc, kc, pl, mask, 0.25)
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        da.det_tree_attention(q, kc, kc, pl, mask[:, :1], 0.25)
    with pytest.raises(ValueError, match="queries reach position"):
        da.det_causal_attention(torch.randn(1, 9, 4, 16, device=DEVICE), kc, kc, 0.25)
    with pytest.raises(ValueError, match="q_offset"):
        da.det_causal_attention(q, kc, kc, 0.25, q_offset=-2)
    order = da.tree_order(pl, mask, 8)
    with pytest.raises(ValueError, match="order"):
        da.det_tree_attention(q, kc, kc, pl, mask, 0.25, order=(order[0], order[1][:, :1], order[2]))
    with pytest.raises(ValueError, match="int32"):
        da.det_tree_attention(q, kc, kc, pl, mask, 0.25, order=(order[0].long(), order[1], order[2]))


def test_deterministic_ops_share_the_order_within_a_forward_and_drop_it_between(monkeypatch):
    """``DeterministicOps`` computes each query's canonical order once per forward (every layer passes
    the same ``prefix_lens`` and mask) and drops it at ``begin_forward``: a round updates those tensors
    in place (static buffers on a GPU), and a stale order would attend over the previous round's slots."""
    from tritonspec.runtime import deterministic
    from tritonspec.runtime.ops import TorchOps

    monkeypatch.setattr(deterministic, "TRITON_DEVICES", ("cuda", "cpu"))
    ops = deterministic.DeterministicOps(TorchOps(), DEVICE)
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    kc, vc = torch.randn(1, 40, 2, 16, device=DEVICE), torch.randn(1, 40, 2, 16, device=DEVICE)
    pl, mask = torch.tensor([10], device=DEVICE), torch.tensor([[[True, False], [True, True]]], device=DEVICE)
    ops.begin_forward()
    first = ops.tree_attention(q, kc, vc, pl, mask, 0.25)
    assert torch.equal(first, da.det_tree_attention(q, kc, vc, pl, mask, 0.25))
    order = ops._order
    assert torch.equal(
        ops.tree_attention(q * 2, kc, vc, pl, mask, 0.25), da.det_tree_attention(q * 2, kc, vc, pl, mask, 0.25)
    )
    assert ops._order is order  # the next layer reused it
    pl[0] = 25  # the next round, in place
    mask[0, 1, 0] = False
    ops.begin_forward()
    assert torch.equal(ops.tree_attention(q, kc, vc, pl, mask, 0.25), da.det_tree_attention(q, kc, vc, pl, mask, 0.25))
    assert not torch.equal(ops.tree_attention(q, kc, vc, pl, mask, 0.25), first)
    prompt = ops.prefill_attention(q, kc[:, :2], vc[:, :2], 0.25)
    assert torch.equal(prompt, da.det_causal_attention(q, kc[:, :2], vc[:, :2], 0.25))


# ------------------------------------------------------------------ end to end (deterministic mode)
SPECS = {"chain": ts.SpecConfig.chain(3), "tree": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6)}


def _speculative_equals_plain(monkeypatch, shape: str, lengths: list[int], new_tokens: int) -> int:
    from tritonspec.runtime import deterministic
    from tritonspec.runtime.audit import generate_recorded

    # the GPU's configuration: the Triton backend, the batch-invariant matmul, Triton RMSNorm and this
    # attention (under the interpreter on a CPU: the matmul on unpacked weights, cpu_linear="torch")
    monkeypatch.setattr(deterministic, "TRITON_DEVICES", ("cuda", "cpu"))
    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.4, target_overrides=dict(num_hidden_layers=4))
    on = dict(device="cuda") if DEVICE == "cuda" else dict(cpu_linear="torch")
    rt = runtime(model, drafter, SPECS[shape], deterministic=True, max_batch_size=2, backend="triton", **on)
    assert rt.ops._det is da and rt.ops._gpu is not None
    launch, launched = da._launch, []
    monkeypatch.setattr(da, "_launch", lambda *a: launched.append(a[-1]) or launch(*a))  # a[-1]: causal
    prompts = random_prompts(24, lengths, seed=3)
    st_, sl = generate_recorded(rt, prompts, max_new_tokens=new_tokens)
    pt, pl = generate_recorded(rt, prompts, max_new_tokens=new_tokens, speculative=False)
    assert st_ == pt
    assert all(torch.equal(a, b) for a, b in zip(sl, pl))
    t1, l1 = generate_recorded(rt, prompts[-1:], max_new_tokens=new_tokens)  # alone = batched
    assert t1[0] == pt[-1] and torch.equal(l1[0], pl[-1])
    assert True in launched and False in launched  # prompts and rounds ran this kernel (not a CPU path)
    return rt.generate(prompts[:1], max_new_tokens=new_tokens).stats.num_drafts


def test_deterministic_gpu_configuration_speculative_equals_plain(monkeypatch):
    assert _speculative_equals_plain(monkeypatch, "chain", [4, 11], 5) > 0


@pytest.mark.slow
def test_deterministic_gpu_configuration_tree_more_prompts(monkeypatch):
    for lengths in ([3, 24], [17, 9]):
        assert _speculative_equals_plain(monkeypatch, "tree", lengths, 10) > 0
