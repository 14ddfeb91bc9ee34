"""All-layer KV compaction kernel vs its reference: bit for bit on the whole cache.

Paths are drawn as the verifier produces them (root first, node ids increasing, -1 padded),
so sources and destinations overlap: a chain accepted at its full depth is already in place,
while deep paths in wide trees move every entry onto slots that other entries read from.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.kv_compact import kv_compact, kv_compact_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def compact_case(draw):
    layers = draw(st.integers(1, 3))
    b_max = draw(st.integers(1, 4))
    batch = draw(st.integers(1, b_max))
    n_tree = draw(st.integers(1, 12))  # tree nodes incl. the root
    width = draw(st.integers(1, 8))  # max_depth + 1
    S = n_tree + draw(st.integers(0, 20))
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([1, 8, 33]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    nodes, start = [], []
    for _ in range(batch):
        kind = draw(st.sampled_from(["random", "in_place", "root_only", "shifted"]))
        k = draw(st.integers(0, min(width, n_tree) - 1))  # accepted draft tokens
        if kind == "in_place":
            ids = list(range(1, k + 1))
        elif kind == "root_only":
            ids = []
        elif kind == "shifted":
            ids = list(range(n_tree - k, n_tree))
        else:
            ids = sorted(draw(st.sets(st.integers(1, n_tree - 1), min_size=k, max_size=k))) if n_tree > 1 else []
        nodes.append([0] + ids + [-1] * (width - 1 - len(ids)))
        start.append(draw(st.integers(0, S - n_tree)))
    seed = draw(st.integers(0, 2**16))
    return layers, b_max, S, hkv, d, dtype, nodes, start, seed


@settings(max_examples=40, deadline=None)
@given(compact_case())
def test_kv_compact_matches_reference(case):
    layers, b_max, S, hkv, d, dtype, nodes, start, seed = case
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, b_max, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(layers, b_max, S, hkv, d, generator=g).to(dtype).to(DEVICE)
    nodes_t = torch.tensor(nodes, dtype=torch.int64, device=DEVICE)
    start_t = torch.tensor(start, dtype=torch.int64, device=DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    kv_compact(k, v, start_t, nodes_t)
    kv_compact_reference(k_ref, v_ref, start_t, nodes_t)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_kv_compact_long_overlapping_path():
    # path 0, 2, 3, ..., 16: every destination start+j (j >= 2) is the source of entry j-1
    L, S, hkv, d = 2, 40, 2, 64
    k = torch.randn(L, 1, S, hkv, d, device=DEVICE)
    v = torch.randn(L, 1, S, hkv, d, device=DEVICE)
    nodes = torch.tensor([[0] + list(range(2, 17))], device=DEVICE)
    start = torch.tensor([5], device=DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    kv_compact(k, v, start, nodes)
    kv_compact_reference(k_ref, v_ref, start, nodes)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_kv_compact_rejects_bad_arguments():
    k = torch.zeros(2, 2, 8, 1, 4, device=DEVICE)
    nodes = torch.tensor([[0, 1]], device=DEVICE)
    start = torch.tensor([0], device=DEVICE)
    with pytest.raises(TypeError, match="v_cache must have dtype"):
        kv_compact(k, k.half(), start, nodes)
    with pytest.raises(ValueError, match="k_cache must be 5-D"):
        kv_compact(k[0], k[0], start, nodes)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        kv_compact(k.transpose(1, 2), k.transpose(1, 2), start, nodes)
    with pytest.raises(TypeError, match="nodes must have dtype"):
        kv_compact(k, k.clone(), start, nodes.int())
    with pytest.raises(ValueError, match="start must have shape"):
        kv_compact(k, k.clone(), torch.tensor([0, 0], device=DEVICE), nodes)
    with pytest.raises(ValueError, match="cache holds only"):
        kv_compact(k, k.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE), nodes.repeat(3, 1))
