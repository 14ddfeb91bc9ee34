"""The eager CPU round's index bookkeeping: each PyTorch reference against its C operator
(``kernels/cpu_tree.py``), at the shapes of a demo round (a 5-node top-1 tree plus an 8-token lookup
branch: 13 nodes, depth 8; an 800-token history; the demo target's 12-layer cache), batch 1 and 4.

    python -m pytest perf/bench_cpu_tree.py --benchmark-only --benchmark-json /tmp/cpu_tree.json

``extra_info["us_per_call"]``: the median of 5 rounds of 20 calls. The C rows skip, saying why, where
the native operators do not build.
"""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_tree
from tritonspec.kernels.kv_compact import kv_compact_reference
from tritonspec.kernels.verify import verify_greedy_reference
from tritonspec.runtime.ngram import graft_chain, ngram_lookup
from tritonspec.runtime.tree import build_tree

N_TREE, D_TREE, M_LOOKUP, HIST, LAYERS = 5, 4, 8, 800, 12


def _case(op: str, B: int):
    """``(reference, C launcher, args)`` of one op at a demo round's shapes."""
    g = torch.Generator().manual_seed(0)
    chain_par = torch.arange(N_TREE).expand(B, N_TREE) - 1  # the top-1 chain below the root
    if op == "verify_greedy":
        N = N_TREE + M_LOOKUP
        par = torch.cat([chain_par, torch.tensor([0, *range(N_TREE, N - 1)]).expand(B, M_LOOKUP)], 1)
        tok = torch.randint(0, 50, (B, N), generator=g)
        am = tok.gather(1, torch.arange(1, N + 1).clamp(max=N - 1).expand(B, N))  # mostly accepted
        return verify_greedy_reference, cpu_tree.verify_greedy, (tok, par, am, M_LOOKUP)
    if op == "build_tree":
        keep = torch.arange(D_TREE).expand(B, D_TREE).contiguous()
        cparent = (torch.arange(D_TREE) - 1).expand(B, D_TREE).contiguous()
        return build_tree, cpu_tree.build_tree, (keep, cparent, torch.arange(1, D_TREE + 1), D_TREE)
    if op == "ngram_lookup":
        hist = torch.randint(0, 30, (B, HIST + 64), generator=g)
        return ngram_lookup, cpu_tree.ngram_lookup, (hist, torch.full((B,), HIST - 1), M_LOOKUP, 3, 2)
    if op == "graft_chain":
        tok = torch.randint(0, 50, (B, N_TREE), generator=g)
        mask = torch.ones(N_TREE, N_TREE, dtype=torch.bool).tril().expand(B, N_TREE, N_TREE).contiguous()
        chain = torch.cat([tok[:, 1:3], torch.randint(50, 60, (B, M_LOOKUP - 2), generator=g)], 1)
        valid = torch.ones(B, M_LOOKUP, dtype=torch.bool)
        args = (tok, chain_par.contiguous(), torch.arange(N_TREE).expand(B, N_TREE).contiguous(), mask, chain, valid)
        return graft_chain, cpu_tree.graft_chain, args
    if op == "kv_compact":
        k = torch.randn(LAYERS, B, HIST + 32, 2, 32, generator=g)
        nodes = torch.tensor([0, 1, 2, 6, -1, -1, -1, -1, -1]).expand(B, 9).contiguous()
        return kv_compact_reference, cpu_tree.kv_compact, (k, k.clone(), torch.full((B,), HIST), nodes)
    raise ValueError(op)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("impl", ["torch", "c"])
@pytest.mark.parametrize("op", ["verify_greedy", "build_tree", "ngram_lookup", "graft_chain", "kv_compact"])
def test_cpu_tree(benchmark, op, impl, batch):
    reference, launcher, args = _case(op, batch)
    if impl == "c":
        why = cl.native_op()
        if why is not None:
            pytest.skip(f"the native CPU operators did not build here: {why}")
    fn = reference if impl == "torch" else launcher
    with torch.inference_mode():
        out = fn(*args)
        if impl == "c":  # None / False: it declined, and the row would time nothing
            assert out is not None and out is not False, "the C operator declined these inputs"

        def many():
            for _ in range(20):
                fn(*args)

        benchmark.pedantic(many, rounds=5, warmup_rounds=1, iterations=1)
    if benchmark.stats is not None:  # --benchmark-disable (CI): ran once, nothing timed
        benchmark.extra_info.update(
            op=op, impl=impl, batch=batch, us_per_call=round(benchmark.stats["median"] / 20 * 1e6, 2)
        )
