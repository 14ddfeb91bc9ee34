"""The round's index bookkeeping as C operators (``kernels/cpu_tree.py``, ``kernels/cpu/tree_ops.c``):
each equals its PyTorch reference exactly on drawn inputs (ragged batches, padding nodes, duplicate
tokens, histories read through a column slice), returns None where it must not run (traced), and an
eager CPU decode runs them and emits the tokens the references give."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree import synthetic_candidates

import tritonspec as ts
from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_tree
from tritonspec.kernels.verify import verify_greedy_reference
from tritonspec.kernels.verify_chain import verify_chain_reference
from tritonspec.runtime import decode as decode_module
from tritonspec.runtime.ngram import graft_chain, ngram_lookup
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.tree import build_tree, rerank

from _util import perm_pair, runtime

WHY = cl.native_op()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the native CPU operators did not build here: {WHY}")


def _equal(got, want, names):
    assert got is not None, "the C operator did not run (the comparison would hold vacuously)"
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"


# ================================================================== verify_greedy
@st.composite
def verify_case(draw):
    B, N, D = draw(st.integers(1, 5)), draw(st.integers(1, 24)), draw(st.integers(0, 9))
    vocab = draw(st.sampled_from([1, 2, 3, 50]))  # tiny vocabularies: duplicate sibling tokens
    par = [[-1] + [draw(st.integers(-1, i - 1)) for i in range(1, N)] for _ in range(B)]  # -1: padding nodes
    tok = [[draw(st.integers(0, vocab - 1)) for _ in range(N)] for _ in range(B)]
    am = []
    for b in range(B):  # mostly follow a child: long accepted paths
        row = []
        for i in range(N):
            kids = [c for c in range(1, N) if par[b][c] == i]
            follow = kids and draw(st.booleans())
            row.append(tok[b][draw(st.sampled_from(kids))] if follow else draw(st.integers(0, vocab)))
        am.append(row)
    return torch.tensor(tok), torch.tensor(par), torch.tensor(am), D


@settings(max_examples=150, deadline=None)
@given(verify_case())
def test_verify_greedy_equals_reference(case):
    _equal(cpu_tree.verify_greedy(*case), verify_greedy_reference(*case), ("nodes", "num", "emitted"))


def test_verify_greedy_known_answer_and_the_comparison_sees_one_changed_entry():
    """A chain accepted in full (then the bonus token); inverse: ``_equal`` fails on one changed count."""
    tok, par = torch.tensor([[5, 7, 9, 4]]), torch.tensor([[-1, 0, 1, 2]])
    am = torch.tensor([[7, 9, 4, 3]])
    nodes, num, emitted = got = cpu_tree.verify_greedy(tok, par, am, 3)
    assert num.tolist() == [3] and emitted.tolist() == [[7, 9, 4, 3]] and nodes.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(AssertionError, match="num"):
        _equal((got[0], got[1] - 1, got[2]), verify_greedy_reference(tok, par, am, 3), ("nodes", "num", "emitted"))


# ================================================================== build_tree
@settings(max_examples=80, deadline=None)
@given(
    K=st.integers(1, 5),
    D=st.integers(1, 5),
    frac=st.floats(0.01, 1.0),
    seed=st.integers(0, 10_000),
    ties=st.booleans(),
    rows=st.integers(1, 3),
)
def test_build_tree_equals_reference(K, D, frac, seed, ties, rows):
    cands = [synthetic_candidates(K, D, seed + r, ties) for r in range(rows)]
    scores = torch.cat([c[0] for c in cands])
    cparent, cdepth = torch.cat([c[1] for c in cands]), cands[0][2]
    keep = rerank(scores, max(1, int(frac * scores.shape[1])))
    for depth in (D, max(D - 2, 0)):  # a max_depth below the tree's cuts the ancestor walk alike
        args = (keep, cparent, cdepth, depth)
        _equal(cpu_tree.build_tree(*args), build_tree(*args), ("parents", "depth", "mask"))


def test_build_tree_refuses_ids_outside_the_candidates():
    with pytest.raises(RuntimeError, match="keep id 7 outside"):
        cpu_tree.build_tree(torch.tensor([[0, 7]]), torch.tensor([[-1, 0, 0]]), torch.tensor([1, 2, 2]), 2)


# ================================================================== ngram_lookup
@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-1, 3), min_size=1, max_size=40), min_size=1, max_size=4),
    m=st.integers(1, 8),
    n_max=st.integers(1, 4),
    n_min_off=st.integers(0, 4),
    junk=st.integers(-1, 3),
    extra=st.integers(0, 5),
    cut=st.integers(0, 3),
)
def test_ngram_lookup_equals_reference(rows, m, n_max, n_min_off, junk, extra, cut):
    """Every entry (the invalid ones too), through a column slice of a wider history (as the decoder
    reads it), with -1 junk past the roots (the decoder's emitted padding) and -1 tokens inside the
    rows (the reference's padding before a sequence matches them)."""
    n_min = n_max - n_min_off  # down to n_min <= 0: every position matches
    S = max(len(r) for r in rows) + extra
    hist = torch.full((len(rows), S + cut), junk, dtype=torch.int64)
    for b, r in enumerate(rows):
        hist[b, : len(r)] = torch.tensor(r)
    hist = hist[:, :S]
    L = torch.tensor([len(r) - 1 for r in rows])
    _equal(cpu_tree.ngram_lookup(hist, L, m, n_max, n_min), ngram_lookup(hist, L, m, n_max, n_min), ("chain", "valid"))


def test_ngram_lookup_refuses_a_root_past_the_history():
    with pytest.raises(RuntimeError, match="L = 4 >= S = 4"):
        cpu_tree.ngram_lookup(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4]), 2, 2, 1)


# ================================================================== graft_chain
@st.composite
def graft_case(draw):
    B, N, M = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 6))
    tokens, parents, depth = [], [], []
    mask = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        par, tok, dep = [-1], [draw(st.integers(0, 5))], [0]
        for j in range(1, N):
            p = draw(st.integers(-1, j - 1))  # -1: a padding node (sees itself only)
            used = {tok[c] for c in range(1, j) if par[c] == p}
            tok.append(draw(st.sampled_from([t for t in range(12) if t not in used])))  # distinct siblings
            par.append(p)
            dep.append(dep[p] + 1 if p >= 0 else draw(st.integers(0, 2)))
        for j in range(N):
            u = j
            while u >= 0:
                mask[b, j, u] = True
                u = par[u]
        tokens.append(tok), parents.append(par), depth.append(dep)
    chain = [[draw(st.integers(0, 4)) for _ in range(M)] for _ in range(B)]
    valid = [[r < v for r in range(M)] for v in (draw(st.integers(0, M)) for _ in range(B))]
    T = torch.tensor
    return T(tokens), T(parents), T(depth), mask, T(chain), T(valid)


@settings(max_examples=300, deadline=None)
@given(graft_case())
def test_graft_chain_equals_reference(case):
    _equal(cpu_tree.graft_chain(*case), graft_chain(*case), ("tokens", "parents", "depth", "mask", "added"))


# ================================================================== where they run
def test_traced_calls_return_none_so_the_references_run():
    """Under a tracer (make_fx: what torch.compile and the fake-tensor pass see) every operator declines,
    so compiled rounds trace the references (inverse: eager calls do run it, see the tests above)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    def f(tok, par, am):
        seen.append(cpu_tree.verify_greedy(tok, par, am, 2))
        return verify_greedy_reference(tok, par, am, 2)[0]

    args = (torch.tensor([[5, 7, 9]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[7, 9, 3]]))
    make_fx(f)(*args)
    assert seen == [None]
    assert cpu_tree.verify_greedy(*args, 2) is not None


@pytest.mark.parametrize("spec", ["tree+lookup", "chain"])
def test_decoding_runs_the_operators_and_emits_the_references_tokens(spec, monkeypatch):
    """A speculative greedy generation with the operators gives the tokens it gives with the references
    (``TorchOps.cpu_index`` off), and the operators really ran in it (counted)."""
    cfg = (
        ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6, prompt_lookup_num_tokens=4)
        if spec == "tree+lookup"
        else ts.SpecConfig.chain(3)
    )
    rt = runtime(*perm_pair("llama", vocab=24, seed=1, alpha=0.15), spec=cfg, max_batch_size=4)
    if not rt.decoder.ops.cpu_index:
        pytest.skip("the CPU kernels do not run here (cpu_linear)")
    prompts = [[1, 5, 9, 5, 9, 5, 9, 3, 5, 9], [7, 3], [2, 4, 6, 8, 2, 4, 6, 8, 2]]
    calls: dict[str, int] = {}
    for name in ("verify_greedy", "build_tree", "ngram_lookup", "graft_chain", "kv_compact", "argmax"):
        real = getattr(cpu_tree, name)

        def counted(*a, _real=real, _name=name):
            out = _real(*a)
            calls[_name] = calls.get(_name, 0) + (out is not None and out is not False)
            return out

        monkeypatch.setattr(cpu_tree, name, counted)
    with_c = rt.generate(prompts, max_new_tokens=24)
    assert min(calls.get(n, 0) for n in ("verify_greedy", "kv_compact", "argmax")) > 0, calls
    if spec == "tree+lookup":
        assert min(calls.get(n, 0) for n in ("build_tree", "ngram_lookup", "graft_chain")) > 0, calls
    monkeypatch.setattr(TorchOps, "cpu_index", property(lambda self: False))
    assert decode_module.cpu_tree is cpu_tree
    before = dict(calls)
    with_refs = rt.generate(prompts, max_new_tokens=24)
    assert calls == before, "cpu_index off: the references ran"
    assert with_c.token_ids == with_refs.token_ids
    assert with_c.token_ids == rt.generate(prompts, max_new_tokens=24, speculative=False).token_ids
    assert with_c.stats.mean_acceptance_length > 1.3  # drafts were accepted: the walk was exercised


# ================================================================== argmax
@settings(max_examples=150, deadline=None)
@given(
    lead=st.sampled_from([(), (1,), (3,), (2, 5)]),
    V=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    specials=st.lists(st.tuples(st.integers(0, 69), st.sampled_from(["nan", "inf", "-inf", "max", "0", "-0"]))),
    levels=st.integers(1, 5),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_argmax_equals_torch(lead, V, dtype, specials, levels, threads, seed):
    """``x.argmax(-1)`` exactly: ties (values drawn from a few levels, so most rows hold repeated maxima),
    NaN (the first one wins), infinities, -0.0 beside +0.0, V below, at and past a 16-lane block, leading
    dimensions, bfloat16, 1 and 2 threads."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels, (*lead, V), generator=g).float() * 0.5
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "0": 0.0, "-0": -0.0}
    flat = x.view(-1, V)
    for i, (col, kind) in enumerate(specials):
        row = flat[i % flat.shape[0]]
        row[col % V] = float(levels) if kind == "max" else value[kind]
    x = x.to(dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_tree.argmax(x)
    finally:
        torch.set_num_threads(saved)
    want = x.argmax(-1)
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (x.tolist(), got.tolist(), want.tolist())


def test_argmax_known_answers_and_what_it_declines():
    """Known answers (first maximum, first NaN, all -inf -> 0, -0.0 before +0.0 -> the first), a 49,152-token
    bfloat16 head row; strided rows and a strided view; float64 and integer inputs decline (None)."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[0.5, 2.0, 2.0, 1.0], [1.0, nan, 3.0, nan], [-inf, -inf, -inf, -inf], [-0.0, 0.0, -1.0, -0.0]])
    assert cpu_tree.argmax(x).tolist() == [1, 1, 0, 0]
    head = torch.randn(3, 49152).bfloat16()
    head[1, 40000] = 100.0
    assert torch.equal(cpu_tree.argmax(head), head.argmax(-1)) and int(cpu_tree.argmax(head)[1]) == 40000
    wide = torch.randn(4, 50)
    assert torch.equal(cpu_tree.argmax(wide[:, 3:40]), wide[:, 3:40].argmax(-1))
    assert torch.equal(cpu_tree.argmax(wide.t()), wide.t().argmax(-1))
    assert cpu_tree.argmax(torch.randn(2, 5, dtype=torch.float64)) is None
    assert cpu_tree.argmax(torch.arange(6).view(2, 3)) is None


# ================================================================== kv_compact
@settings(max_examples=80, deadline=None)
@given(
    L=st.integers(1, 3),
    B=st.integers(1, 3),
    extra_rows=st.integers(0, 2),
    W=st.integers(1, 6),
    heads=st.sampled_from([(1, 4), (2, 8), (3, 5)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_kv_compact_equals_reference(L, B, extra_rows, W, heads, dtype, data):
    """Rows as the decoder passes them: an accepted path (the root, then increasing node ids, then -1)
    or an idle row (all -1); the other cache rows and slots stay untouched."""
    S = 24
    start = torch.tensor([data.draw(st.integers(0, S - 12)) for _ in range(B)])
    nodes = torch.full((B, W), -1, dtype=torch.int64)
    for b in range(B):
        if data.draw(st.booleans()) or b == 0:
            ids = sorted(data.draw(st.sets(st.integers(1, 10), max_size=W - 1)))
            nodes[b, : 1 + len(ids)] = torch.tensor([0, *ids])
    k = torch.randn(L, B + extra_rows, S, *heads).to(dtype)
    v = torch.randn(L, B + extra_rows, S, *heads).to(dtype)
    k2, v2 = k.clone(), v.clone()
    from tritonspec.kernels.kv_compact import kv_compact_reference

    assert cpu_tree.kv_compact(k, v, start, nodes), "the C operator did not run"
    kv_compact_reference(k2, v2, start, nodes)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_kv_compact_moves_the_path_and_refuses_slots_past_the_cache():
    k = torch.arange(2 * 1 * 8 * 2, dtype=torch.float32).view(2, 1, 8, 2)  # [L, B, S, D]: slot s holds 2s, 2s+1
    v = k.clone()
    assert cpu_tree.kv_compact(k, v, torch.tensor([1]), torch.tensor([[0, 2, 5, -1]]))
    assert k[0, 0, :, 0].tolist() == [0, 2, 6, 12, 8, 10, 12, 14]  # slots 1, 2, 3 <- 1, 3, 6
    with pytest.raises(RuntimeError, match="outside"):
        cpu_tree.kv_compact(k, v, torch.tensor([4]), torch.tensor([[0, 5]]))


def test_kv_compact_declines_caches_whose_slots_are_not_contiguous():
    """A v cache of another layout: the launcher declines (the reference runs) and the operator itself
    refuses before writing either cache."""
    k = torch.arange(16.0).view(1, 1, 8, 2)
    v = torch.arange(16.0).view(1, 1, 2, 8).transpose(2, 3)  # [L, B, S, D] with slots 1 apart
    before = k.clone()
    assert cpu_tree.kv_compact(k, v, torch.tensor([0]), torch.tensor([[0, 2]])) is False
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tritonspec_cpu.kv_compact(k, v, torch.tensor([0]), torch.tensor([[0, 2]]))
    assert torch.equal(k, before)


# ================================================================== the drafter's packed weights, once a round
def test_packed_weights_are_checked_once_a_round_and_restored_after_an_error(monkeypatch):
    """``generate`` checks the drafter's packed copy once per eager round (not at each of its ~9 drafter
    calls), a weight changed between rounds is repacked at the next one, and an error inside the block
    leaves no stale entry behind."""
    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.15)
    rt = runtime(model, drafter, ts.SpecConfig(3, 2, 6), max_batch_size=4)
    dr = rt.decoder.drafter
    if not dr.packs_on(rt.decoder.ops):
        pytest.skip("the drafter runs unpacked here (no AVX2 panel kernels)")
    checks = []
    real = type(dr)._versions
    monkeypatch.setattr(type(dr), "_versions", lambda self: checks.append(1) or real(self))
    out = rt.generate([[1, 5, 9, 3]], max_new_tokens=20)
    rounds = out.stats.num_drafts
    assert rounds > 2 and len(checks) <= rounds + 4, (len(checks), rounds)  # + the prefill's catch-up
    with pytest.raises(RuntimeError, match="inside"), dr.packed_for_round(rt.decoder.ops):
        raise RuntimeError("an error inside the round")
    assert dr._round_pack is None
    with torch.no_grad():  # changed between rounds: the next round's entry repacks
        dr.fc.weight.mul_(2)
    with torch.inference_mode(), dr.packed_for_round(rt.decoder.ops):
        packed = dr._cpu_weights(rt.decoder.ops)["fc"]
    assert torch.equal(cl.unpack(packed), dr.fc.weight)


# ================================================================== row_random
@settings(max_examples=60, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=5),
    counters=st.data(),
    n=st.integers(0, 9),
    vocab=st.one_of(st.integers(0, 300), st.sampled_from([4096])),
)
def test_row_random_is_the_python_draw(seeds, counters, n, vocab):
    """The whole draw as one C call (``row_random``, what ``draw(native=True)`` runs) gives the Python draw's
    uniforms and noise (from ``RowRandom.hashes``' words) bit for bit, each row at its own counter (past 2^32
    included), float32 and in range (u in [0, 1), noise > 0), and advances the counters by one alike, round
    after round."""
    from tritonspec.runtime.sampling import RowRandom

    a, b = RowRandom(seeds, torch.device("cpu")), RowRandom(seeds, torch.device("cpu"))
    c = torch.tensor([counters.draw(st.integers(0, 2**40)) for _ in seeds])
    a.counter.copy_(c)
    b.counter.copy_(c)
    for _ in range(2):
        got = cpu_tree.row_random(a.key, a.counter, n, vocab)
        assert got is not None, "the C operator did not run"
        u, e = got
        u2, e2 = b.draw(n, vocab)
        assert u.dtype == e.dtype == torch.float32 and u.shape == (len(seeds), n) and e.shape == (len(seeds), vocab)
        assert torch.equal(u, u2) and torch.equal(e, e2) and torch.equal(a.counter, b.counter)
        assert bool((u >= 0).all() and (u < 1).all() and (e > 0).all())


def test_row_random_sees_the_counter_and_the_key():
    """Inverse: another round (counter + 1) or another seed changes the draws."""
    from tritonspec.runtime.sampling import RowRandom

    r = RowRandom([3, 4], torch.device("cpu"))
    u, e = cpu_tree.row_random(r.key, r.counter.clone(), 2, 50)
    u1, e1 = cpu_tree.row_random(r.key, r.counter + 1, 2, 50)
    assert not torch.equal(u, u1) and not torch.equal(e, e1)
    assert not torch.equal(u[0], u[1]) and not torch.equal(e[0], e[1])


# ================================================================== verify_chain
@st.composite
def chain_case(draw):
    B, N = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    V = draw(st.sampled_from([1, 2, 5, 64, 300]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    sharp = draw(st.sampled_from([0.5, 3.0, 12.0]))  # flat to near one-hot distributions
    probs = (torch.randn(B, N, V, generator=g) * sharp).softmax(-1)
    q = (torch.randn(B, max(N - 1, 0), V, generator=g) * sharp).softmax(-1)
    kind = draw(st.sampled_from(["free", "q_is_p", "q_above_p", "q_zero", "ties", "exact_coin", "nan"]))
    if kind == "q_is_p" and N > 1:  # every draft accepted with p == q; a rejection's residual all zero
        q = probs[:, 1:].clone() if draw(st.booleans()) else probs[:, :-1].clone()
    tokens = torch.randint(0, V, (B, N), generator=g)
    if draw(st.booleans()) and N > 1:  # drafts drawn where q has mass: long accepted runs
        tokens[:, 1:] = q.argmax(-1)
    if kind == "q_zero" and N > 1:
        q[torch.arange(B), 0, tokens[:, 1]] = 0.0
    u = torch.rand(B, N, generator=g)
    if kind == "q_above_p" and N > 1:  # q = 2p: a coin above 1/2 rejects, and the residual is all zero (p's race)
        q = probs[:, :-1] * 2
        u[:, 1:] = 0.5 + u[:, 1:] / 2 + 1e-3
    if kind == "nan":  # a NaN in p (the race takes it) or in q (the residual falls back to p), as the reference
        into_q = N > 1 and draw(st.booleans())
        t, n = (q, N - 1) if into_q else (probs, N)
        t[draw(st.integers(0, B - 1)), draw(st.integers(0, n - 1)), draw(st.integers(0, V - 1))] = float("nan")
    if kind == "exact_coin" and N > 1:  # u * q == p exactly at depth 1: accepted (<=)
        x = tokens[:, 1]
        q[torch.arange(B), 0, x] = 0.5
        u[:, 1] = 0.25
        probs[torch.arange(B), 0, x] = 0.125
    xi = torch.rand(B, V, generator=g) + 0.05
    if kind == "ties":  # equal race values: the first maximal index wins
        probs = torch.full((B, N, V), 1.0 / V)
        xi = torch.ones(B, V)
    return tokens, probs, q, u, xi


@settings(max_examples=200, deadline=None)
@given(chain_case())
def test_verify_chain_equals_reference(case):
    _equal(cpu_tree.verify_chain(*case), verify_chain_reference(*case), ("nodes", "num", "emitted"))


def test_verify_chain_known_answers_and_what_the_comparison_sees():
    """Two drafts, the second rejected: the bonus is the residual's race winner; a NaN residual falls
    back to p as in the reference; a coin moved past p(x) / q(x) changes the count (inverse)."""
    V = 4
    tokens = torch.tensor([[0, 1, 2]])
    probs = torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.1, 0.5, 0.3, 0.1], [0.1, 0.1, 0.7, 0.1]]])
    u = torch.tensor([[0.0, 0.9, 0.5]])  # depth 1: 0.9 * 0.5 <= 0.6; depth 2: 0.5 * 0.7 > 0.2
    xi = torch.ones(1, V)
    nodes, num, emitted = cpu_tree.verify_chain(tokens, probs, q, u, xi)
    assert num.tolist() == [1] and nodes.tolist() == [[0, 1, -1]] and emitted.tolist() == [[1, 3, -1]]
    _equal((nodes, num, emitted), verify_chain_reference(tokens, probs, q, u, xi), ("nodes", "num", "emitted"))
    u2 = u.clone()
    u2[0, 2] = 0.1  # 0.1 * 0.7 <= 0.2: depth 2 accepted, the bonus drawn from p at depth 2 (a tie: index 0)
    assert [t.tolist() for t in cpu_tree.verify_chain(tokens, probs, q, u2, xi)] == [[[0, 1, 2]], [2], [[1, 2, 0]]]
    p2 = probs.clone()
    p2[0, 0, 1] = 0.3  # 0.9 * 0.5 > 0.3: depth 1 rejected
    got = cpu_tree.verify_chain(tokens, p2, q, u, xi)
    assert got[1].tolist() == [0]
    _equal(got, verify_chain_reference(tokens, p2, q, u, xi), ("nodes", "num", "emitted"))
    bad = probs.clone()
    bad[0, 1, 0] = float("nan")
    _equal(cpu_tree.verify_chain(tokens, bad, q, u, xi), verify_chain_reference(tokens, bad, q, u, xi), ("n", "c", "e"))
    with pytest.raises(RuntimeError, match="outside"):
        cpu_tree.verify_chain(tokens + 3, probs, q, u, xi)


def test_sampled_decoding_draws_through_the_operator_with_the_references_tokens(monkeypatch):
    """Seeded sampling with the C words and the C chain verification (both counted) emits the
    tokens it emits with the references."""
    rt = runtime(*perm_pair("llama", vocab=24, seed=1, alpha=0.15), spec=ts.SpecConfig.chain(3), max_batch_size=4)
    if not rt.decoder.ops.cpu_index:
        pytest.skip("the CPU kernels do not run here (cpu_linear)")
    prompts = [[1, 5, 9, 5, 9, 5, 9, 3, 5, 9], [7, 3], [2, 4, 6, 8, 2, 4, 6, 8, 2]]
    calls = []
    real = cpu_tree.row_random

    def counted(*a):
        out = real(*a)
        if out is not None:  # only where the operator ran
            calls.append(1)
        return out

    chains = []
    real_chain = cpu_tree.verify_chain

    def counted_chain(*a):
        out = real_chain(*a)
        if out is not None:
            chains.append(1)
        return out

    monkeypatch.setattr(cpu_tree, "row_random", counted)
    monkeypatch.setattr(cpu_tree, "verify_chain", counted_chain)
    kw = dict(max_new_tokens=24, temperature=1.0, seed=11)
    with_c = rt.generate(prompts, **kw)
    assert len(calls) > 0 and len(chains) > 0
    monkeypatch.setattr(TorchOps, "cpu_index", property(lambda self: False))
    n, m = len(calls), len(chains)
    with_refs = rt.generate(prompts, **kw)
    assert (len(calls), len(chains)) == (n, m), "cpu_index off: the references ran"
    assert with_c.token_ids == with_refs.token_ids
