"""Tree attention and kv_write kernels.

Stated tolerances (inputs ~ N(0, 1), outputs O(1)): every query's output is within
``ATOL[dtype]`` (absolute, elementwise) of float64 attention computed from the same
(dtype-rounded) q/K/V, namely

  * tree masks: plain causal attention over the query's own root-to-node path (the prefix,
    then the path's tree slots in order) — vLLM's tree-attention property;
  * a causal tree mask: ordinary causal attention over prefix + T keys, queries bottom-right
    aligned — FlashInfer's custom-mask == causal property;

    ATOL = fp32 2e-5, fp16 2e-3, bf16 1.6e-2.

Invariance (bit for bit): the ``kv_len`` hint, the number of rows in the batch, the cache row
a request sits in and the queries after a query never change that query's result. A query
that sees no key at all returns zeros (as the reference's SDPA does). kv_write is bit-identical
to its reference (slot -1 goes to the trash slot S-1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402
from tritonspec.kernels.tree_attention import tree_attention, tree_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPLIT = 64  # small flash-decoding split so that short prefixes cross several split boundaries
HEADS = [(1, 1), (4, 2), (4, 1), (2, 2)]  # (Hq, Hkv)


def random_parents(shape: str, n: int, g: torch.Generator) -> list[int]:
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "siblings":
            parents.append(0)
        elif shape == "padding" and i == n - 1:
            parents.append(-1)
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=g)))
    return parents


def ancestors(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def attention64(q, keys, values, scale):
    """float64 softmax attention of ``q [Hq, D]`` over ``keys/values [n, Hkv, D]``."""
    hq, hkv = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
    v = values.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)


@st.composite
def tree_case(draw):
    batch = draw(st.integers(1, 3))
    n = draw(st.sampled_from([1, 2, 5, 7, 12]))
    hq, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([16, 32, 40]))
    dtype = draw(st.sampled_from(DTYPES))
    prefix = draw(st.lists(st.sampled_from([0, 1, 63, 64, 65, 130]), min_size=batch, max_size=batch))
    shapes = draw(st.lists(st.sampled_from(["random", "chain", "siblings", "padding"]), min_size=batch, max_size=batch))
    extra_rows = draw(st.integers(0, 1))
    seed = draw(st.integers(0, 2**16))
    return batch, n, hq, hkv, d, dtype, prefix, shapes, extra_rows, seed


def _setup(batch, n, hq, hkv, d, dtype, prefix, shapes, extra_rows, seed):
    g = torch.Generator().manual_seed(seed)
    S = max(prefix) + n + 3
    q = torch.randn(batch, n, hq, d, generator=g).to(dtype).to(DEVICE)
    k_cache = torch.randn(batch + extra_rows, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(batch + extra_rows, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    parents = [random_parents(s, n, g) for s in shapes]
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            mask[b, i, ancestors(parents[b], i)] = True
    prefix_lens = torch.tensor(prefix, dtype=torch.int64, device=DEVICE)
    return q, k_cache, v_cache, prefix_lens, mask.to(DEVICE), parents


@settings(max_examples=30, deadline=None)
@given(tree_case())
def test_tree_attention_equals_path_causal_attention(case):
    batch, n, hq, hkv, d, dtype, prefix, shapes, extra_rows, seed = case
    q, k_cache, v_cache, prefix_lens, mask, parents = _setup(*case)
    scale = d**-0.5
    out = tree_attention(q, k_cache, v_cache, prefix_lens, mask, scale, split_kv=SPLIT)
    assert out.dtype == q.dtype and out.shape == q.shape
    for b in range(batch):
        P = prefix[b]
        for i in range(n):
            slots = list(range(P)) + [P + t for t in ancestors(parents[b], i)]
            want = attention64(q[b, i], k_cache[b, slots], v_cache[b, slots], scale)
            err = (out[b, i].double() - want).abs().max().item()
            assert err <= ATOL[dtype], f"row {b} node {i}: {err} > {ATOL[dtype]}"
    # the reference agrees within the same tolerance; the kv_len hint changes no bit
    ref = tree_attention_reference(q, k_cache, v_cache, prefix_lens, mask, scale)
    assert (out.double() - ref.double()).abs().max().item() <= ATOL[dtype]
    tight = max(prefix) + n
    assert torch.equal(out, tree_attention(q, k_cache, v_cache, prefix_lens, mask, scale, tight, split_kv=SPLIT))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix,T", [(0, 7), (5, 1), (70, 9), (129, 33)])
def test_causal_tree_mask_gives_causal_attention(dtype, prefix, T):
    hq, hkv, d = 4, 2, 32
    g = torch.Generator().manual_seed(prefix + T)
    S = prefix + T
    q = torch.randn(1, T, hq, d, generator=g).to(dtype).to(DEVICE)
    k_cache = torch.randn(1, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(1, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril()[None]
    pl = torch.tensor([prefix], device=DEVICE)
    out = tree_attention(q, k_cache, v_cache, pl, causal, d**-0.5, split_kv=SPLIT)
    # plain causal attention, queries at positions prefix .. prefix+T-1 (bottom-right aligned)
    k = k_cache.double().repeat_interleave(hq // hkv, dim=2).transpose(1, 2)  # [1, Hq, S, D]
    v = v_cache.double().repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    s = torch.einsum("bqhd,bhsd->bhqs", q.double(), k) * d**-0.5
    allowed = torch.arange(S, device=DEVICE)[None, :] <= (prefix + torch.arange(T, device=DEVICE))[:, None]
    want = torch.einsum("bhqs,bhsd->bqhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), v)
    assert (out.double() - want).abs().max().item() <= ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_result_independent_of_batch_queries_and_hint(dtype):
    hq, hkv, d, n = 4, 2, 32, 7
    case = (3, n, hq, hkv, d, dtype, [130, 0, 65], ["random", "chain", "siblings"], 1, 7)
    q, k_cache, v_cache, prefix_lens, mask, _ = _setup(*case)
    full = tree_attention(q, k_cache, v_cache, prefix_lens, mask, 0.2, split_kv=SPLIT)
    # fewer queries (a prefix of the query list): the remaining queries' bits are unchanged
    for m in (1, 4):
        part = tree_attention(
            q[:, :m].contiguous(), k_cache, v_cache, prefix_lens, mask[:, :m].contiguous(), 0.2, split_kv=SPLIT
        )
        assert torch.equal(part, full[:, :m])
    # each request alone, moved to cache row 0
    for b in range(3):
        alone = tree_attention(
            q[b : b + 1].clone(),
            k_cache[b : b + 1].clone(),
            v_cache[b : b + 1].clone(),
            prefix_lens[b : b + 1].clone(),
            mask[b : b + 1].clone(),
            0.2,
            split_kv=SPLIT,
        )
        assert torch.equal(alone[0], full[b])
    # the kv_len hint and a larger cache (more, empty, splits) change nothing
    assert torch.equal(full, tree_attention(q, k_cache, v_cache, prefix_lens, mask, 0.2, 140, split_kv=SPLIT))
    big_k = torch.cat([k_cache, torch.randn_like(k_cache.float()).to(dtype)], dim=1)
    big_v = torch.cat([v_cache, torch.randn_like(v_cache.float()).to(dtype)], dim=1)
    assert torch.equal(full, tree_attention(q, big_k, big_v, prefix_lens, mask, 0.2, split_kv=SPLIT))


def test_tree_attention_default_split_and_empty_visibility():
    hq, hkv, d = 2, 1, 16
    q = torch.randn(2, 3, hq, d, device=DEVICE)
    k_cache = torch.randn(2, 20, hkv, d, device=DEVICE)
    v_cache = torch.randn(2, 20, hkv, d, device=DEVICE)
    pl = torch.tensor([10, 0], device=DEVICE)
    mask = torch.ones(2, 3, 3, dtype=torch.bool, device=DEVICE).tril()
    mask[1, 2] = False  # query with an empty prefix and an empty mask row: sees nothing
    out = tree_attention(q, k_cache, v_cache, pl, mask, 0.25)  # default split (one split here)
    ref = tree_attention_reference(q, k_cache, v_cache, pl, mask, 0.25)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    assert (out - ref).abs().max().item() <= ATOL[torch.float32]
    # a kv_len below prefix+T clips visibility exactly as in the reference
    out_clip = tree_attention(q, k_cache, v_cache, pl, mask, 0.25, 11)
    ref_clip = tree_attention_reference(q, k_cache, v_cache, pl, mask, 0.25, 11)
    assert (out_clip - ref_clip).abs().max().item() <= ATOL[torch.float32]


@settings(max_examples=30, deadline=None)
@given(
    b_max=st.integers(1, 3),
    nq=st.integers(1, 9),
    hkv=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([1, 16, 40]),
    cache_dtype=st.sampled_from(DTYPES),
    src_dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_kv_write_matches_reference(b_max, nq, hkv, d, cache_dtype, src_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    batch = 1 + seed % b_max
    S = nq + 4
    k_cache = torch.randn(b_max, S, hkv, d, generator=g).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(b_max, S, hkv, d, generator=g).to(cache_dtype).to(DEVICE)
    # distinct real slots per row, at most one -1 per row (several -1 race on the trash slot)
    slots = torch.stack([torch.randperm(S - 1, generator=g)[:nq] for _ in range(batch)])
    pad = torch.randint(0, nq + 1, (batch,), generator=g)
    slots[pad < nq, pad[pad < nq]] = -1
    k = torch.randn(batch, nq, hkv, d, generator=g).to(src_dtype).to(DEVICE)
    v = torch.randn(batch, nq, hkv, d, generator=g).to(src_dtype).to(DEVICE)
    slots = slots.to(DEVICE)
    kr, vr = k_cache.clone(), v_cache.clone()
    kv_write(k_cache, v_cache, slots, k, v)
    kv_write_reference(kr, vr, slots, k, v)
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)


@pytest.mark.parametrize("layer", [0, 2])
def test_kv_write_through_the_stacked_cache_equals_a_write_to_the_layer(layer):
    """``layer=``: the write lands in that layer of the stacked ``[L, B, S, H, D]`` cache exactly as a
    write to ``cache[layer]`` does, and touches no other layer (reference and Triton)."""
    g = torch.Generator().manual_seed(layer)
    L, b_max, S, hkv, d = 3, 2, 9, 2, 16
    kc = torch.randn(L, b_max, S, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(L, b_max, S, hkv, d, generator=g).to(DEVICE)
    slots = torch.tensor([[4, -1, 6]], device=DEVICE)
    k = torch.randn(1, 3, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(1, 3, hkv, d, generator=g).to(DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    kv_write_reference(want_k[layer], want_v[layer], slots, k, v)
    for fn in (kv_write_reference, kv_write):
        ks, vs = kc.clone(), vc.clone()
        fn(ks, vs, slots, k, v, layer=layer)
        assert torch.equal(ks, want_k) and torch.equal(vs, want_v), fn.__name__
    assert not torch.equal(want_k, kc)  # inverse: the write did change the cache


def test_kv_write_with_a_layer_writes_the_stack_itself_not_a_view():
    """A compiled round (torch.compile) turns an in-place write through a view of the stacked cache
    into a copy of the whole stack per layer (SmolLM2: ~90 ms a step); ``layer=`` writes with
    ``index_put_`` on the stacked tensor itself. Inverse: ``cache[layer, rows, slot] = x`` does not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.puts = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("index_put_", "_index_put_impl_"):
                self.puts.append(args[0].dim())
            return func(*args, **(kwargs or {}))

    kc, vc = torch.zeros(3, 2, 9, 2, 4), torch.zeros(3, 2, 9, 2, 4)
    slots, k = torch.tensor([[4, -1]]), torch.ones(1, 2, 2, 4)
    with Record() as r:
        kv_write_reference(kc, vc, slots, k, k, layer=1)
    assert r.puts and all(d == 5 for d in r.puts), r.puts
    with Record() as r:
        kc[1, torch.zeros_like(slots), slots] = k
    assert r.puts and all(d == 4 for d in r.puts), r.puts  # the view of layer 1


def test_tree_attention_and_kv_write_reject_bad_arguments():
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    kc = torch.randn(1, 8, 2, 16, device=DEVICE)
    pl = torch.tensor([3], device=DEVICE)
    mask = torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match="k_cache/v_cache dtype"):
        tree_attention(q, kc.half(), kc.half(), pl, mask, 1.0)
    with pytest.raises(TypeError, match="tree_mask must have dtype"):
        tree_attention(q, kc, kc, pl, mask.int(), 1.0)
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        tree_attention(q, kc, kc, pl, mask[:, :1], 1.0)
    with pytest.raises(TypeError, match="prefix_lens must have dtype"):
        tree_attention(q, kc, kc, pl.int(), mask, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        tree_attention(torch.randn(1, 2, 3, 16, device=DEVICE), kc, kc, pl, mask, 1.0)
    with pytest.raises(ValueError, match="k_cache must be contiguous in its last two axes"):
        tree_attention(q, kc.transpose(2, 3).contiguous().transpose(2, 3), kc, pl, mask, 1.0)
    with pytest.raises(ValueError, match="q must have unit stride"):
        tree_attention(torch.randn(1, 2, 4, 32, device=DEVICE)[..., ::2], kc, kc, pl, mask, 1.0)
    with pytest.raises(ValueError, match="split_kv"):
        tree_attention(q, kc, kc, pl, mask, 1.0, split_kv=100)
    slots = torch.tensor([[0, 1]], device=DEVICE)
    k = torch.randn(1, 2, 2, 16, device=DEVICE)
    with pytest.raises(TypeError, match="slots must have dtype"):
        kv_write(kc, kc.clone(), slots.int(), k, k)
    with pytest.raises(ValueError, match="k must have shape"):
        kv_write(kc, kc.clone(), slots, k[:, :1], k)
    with pytest.raises(ValueError, match="v_cache shape"):
        kv_write(kc, kc[:, :4].clone(), slots, k, k)
