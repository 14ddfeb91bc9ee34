"""Prompt lookup inside the draft tree (``runtime/ngram.py``, ``SpecConfig.prompt_lookup_num_tokens``):
the lookup and the graft equal plain-Python references; decoding with the branch is lossless (greedy,
deterministic sampling, captured rounds) and the branch is really accepted where outputs repeat."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.runtime.ngram import graft_chain, ngram_lookup, ngram_lookup_reference
from tritonspec.runtime.profiles import _read_spec, _spec_fields

from _util import perm_pair, runtime

# ================================================================== lookup


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
    m=st.integers(1, 6),
    n_max=st.integers(1, 4),
    n_min_off=st.integers(0, 3),
    junk=st.integers(0, 3),
)
def test_lookup_equals_reference(rows, m, n_max, n_min_off, junk):
    """Every row of a batch (ragged lengths; tokens past the root are junk that must never be read)."""
    n_min = max(1, n_max - n_min_off)
    S = max(len(r) for r in rows) + 3
    hist = torch.full((len(rows), S), junk, dtype=torch.int64)
    for b, r in enumerate(rows):
        hist[b, : len(r)] = torch.tensor(r)
    L = torch.tensor([len(r) - 1 for r in rows])
    tokens, valid = ngram_lookup(hist, L, m, n_max, n_min)
    for b, r in enumerate(rows):
        v = valid[b].tolist()
        assert v == sorted(v, reverse=True), "valid is a prefix"
        assert tokens[b][valid[b]].tolist() == ngram_lookup_reference(r, m, n_max, n_min)


def test_lookup_prefers_the_longest_match_then_a_whole_continuation_then_the_latest():
    ref = ngram_lookup_reference
    assert ref([1, 2, 9, 2, 8, 1, 2], 2, 2, 1) == [9, 2]  # "1 2" (n=2) beats the later "2" (n=1)
    assert ref([5, 7, 1, 5, 6, 5], 2, 1, 1) == [6, 5]  # the latest occurrence with 2 known tokens
    assert ref([5, 7, 1, 5, 6, 5], 3, 1, 1) == [7, 1, 5]  # only the first has 3 known tokens
    assert ref([4, 4], 3, 3, 1) == [4]  # cut at the root
    assert ref([1, 2, 3], 2, 3, 1) == []  # no earlier occurrence


# ================================================================== graft


def _graft_reference(tokens, parents, chain):
    """Walk ``chain`` down the tree (first child holding the token); append the rest as a chain."""
    N = len(tokens)
    cur, added_tok, added_par = 0, [], []
    for g in chain:
        kids = [j for j in range(1, N) if parents[j] == cur and tokens[j] == g]
        if kids and not added_tok:
            cur = kids[0]
            continue
        added_par.append(cur if not added_tok else N + len(added_tok) - 1)
        added_tok.append(g)
    return added_tok, added_par


@st.composite
def trees(draw):
    n = draw(st.integers(1, 10))
    parents, tokens = [-1], [draw(st.integers(0, 5))]
    for j in range(1, n):
        p = draw(st.integers(0, j - 1))
        used = {tokens[c] for c in range(1, j) if parents[c] == p}
        tokens.append(draw(st.sampled_from([t for t in range(12) if t not in used])))  # distinct siblings
        parents.append(p)
    return tokens, parents


@settings(max_examples=300, deadline=None)
@given(tree=trees(), chain=st.lists(st.integers(0, 4), min_size=1, max_size=6), n_valid=st.integers(0, 6))
def test_graft_equals_reference(tree, chain, n_valid):
    tokens, parents = tree
    N, M = len(tokens), len(chain)
    n_valid = min(n_valid, M)
    depth = [0] * N
    mask = torch.zeros(N, N, dtype=torch.bool)
    for j in range(N):
        depth[j] = 0 if j == 0 else depth[parents[j]] + 1
        u = j
        while u >= 0:
            mask[j, u] = True
            u = parents[u]
    valid = torch.tensor([[i < n_valid for i in range(M)]])
    T = torch.tensor
    tok, par, dep, msk, added = graft_chain(T([tokens]), T([parents]), T([depth]), mask[None], T([chain]), valid)
    want_tok, want_par = _graft_reference(tokens, parents, chain[:n_valid])
    a = len(want_tok)
    assert int(added[0]) == a
    assert tok[0, :N].tolist() == tokens and par[0, :N].tolist() == parents
    assert tok[0, N : N + a].tolist() == want_tok and par[0, N : N + a].tolist() == want_par
    assert (par[0, N + a :] == -1).all() and (tok[0, N + a :] == tokens[0]).all()
    for j in range(N + M):  # the mask: ancestors-or-self of a real node; root + self of a padding node
        if j < N + a:
            seen, u = set(), j
            while u >= 0:
                seen.add(u)
                u = int(par[0, u])
            if j >= N:
                assert int(dep[0, j]) == int(dep[0, par[0, j]]) + 1
        else:
            seen = {0, j}
        assert set(torch.nonzero(msk[0, j]).flatten().tolist()) == seen


def test_graft_follows_the_tree_before_adding():
    """Inverse: a chain that is already a path of the tree adds nothing (a graft that ignored the tree
    would add duplicate siblings, which greedy verification never reaches)."""
    tokens, parents, depth = [7, 1, 2, 3], [-1, 0, 1, 0], [0, 1, 2, 1]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    T = torch.tensor
    args = (T([tokens]), T([parents]), T([depth]), mask[None])
    assert graft_chain(*args, T([[1, 2]]), T([[True, True]]))[4].item() == 0
    tok, par, _, _, added = graft_chain(*args, T([[1, 2, 5]]), T([[True, True, True]]))
    assert added.item() == 1 and tok[0, 4].item() == 5 and par[0, 4].item() == 2  # below node 2 ("1 2")


# ================================================================== end to end

SPECS = {
    "chain": ts.SpecConfig.chain(3),
    "tree": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6),
}


def _grafted(stats, spec) -> int:
    """Lookup nodes the rounds verified beyond the drafter's tree (eager CPU rounds count what they kept)."""
    return stats.num_draft_tokens - stats.num_drafts * (spec.num_draft_tokens - 1)


def _repetitive_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: the target's continuation often copies it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(0, vocab, (5 + i % 4,), generator=g).tolist()
        out.append((phrase * 4)[: 9 + 3 * i])
    return out


@pytest.mark.parametrize("shape", sorted(SPECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_with_lookup_equals_plain_and_accepts_the_branch(shape, batch):
    """Lossless, and not vacuous: with a weak drafter the branch raises tau on repetitive prompts."""
    model, drafter = perm_pair("llama", vocab=24, seed=4, alpha=0.9)
    spec = SPECS[shape]
    with_lookup = dataclasses.replace(spec, prompt_lookup_num_tokens=6)
    prompts = _repetitive_prompts(24, 4, seed=batch)[:batch] if batch > 1 else _repetitive_prompts(24, 4, 0)
    taus = {}
    for s in (spec, with_lookup):
        rt = runtime(model, drafter, s, max_batch_size=4)
        out = rt.generate(prompts, max_new_tokens=40)
        plain = rt.generate(prompts, max_new_tokens=40, speculative=False)
        assert out.token_ids == plain.token_ids
        taus[s.prompt_lookup_num_tokens] = out.stats.mean_acceptance_length
        st_ = out.stats
        assert len(st_.accepted_per_position) == s.tree_depth
        if s.prompt_lookup_num_tokens:  # eager CPU rounds count the lookup nodes they kept: some, not always M
            assert st_.num_drafts * (s.num_draft_tokens - 1) < st_.num_draft_tokens
            assert st_.num_draft_tokens < st_.num_drafts * (s.verify_tokens - 1)
        else:
            assert st_.num_draft_tokens == st_.num_drafts * (s.num_draft_tokens - 1)
    assert taus[6] > taus[0] + 0.3, taus


def test_deterministic_sampling_with_lookup_equals_plain_and_batched():
    """Deterministic mode: sampled speculative output (tree + lookup) equals plain sampled output,
    and each row equals its solo run."""
    model, drafter = perm_pair("llama", vocab=24, seed=5, alpha=0.6, target_overrides=dict(num_hidden_layers=4))
    spec = dataclasses.replace(SPECS["tree"], prompt_lookup_num_tokens=5)
    rt = runtime(model, drafter, spec, deterministic=True, max_batch_size=4)
    prompts = _repetitive_prompts(24, 4, seed=3)
    kw = dict(max_new_tokens=24, temperature=0.8, seed=[1, 2, 3, 4])
    out = rt.generate(prompts, **kw)
    assert _grafted(out.stats, spec) > 0  # the branch took part
    assert out.token_ids == rt.generate(prompts, speculative=False, **kw).token_ids
    for i, p in enumerate(prompts):
        assert rt.generate([p], **(kw | {"seed": 1 + i})).token_ids[0] == out.token_ids[i]


def test_captured_round_with_lookup_equals_eager():
    """Whole-cache rounds (what a CUDA graph captures: all M lookup nodes, padding included) give the
    eager rounds' tokens (eager CPU rounds cut the padding nodes), greedy and sampled trees."""
    from tritonspec.runtime.graphs import GraphRunner, default_sizes

    model, drafter = perm_pair("llama", vocab=24, seed=6, alpha=0.6)
    spec = dataclasses.replace(SPECS["tree"], prompt_lookup_num_tokens=4)
    eager = runtime(model, drafter, spec, cuda_graphs=False)
    graph = runtime(model, drafter, spec, cuda_graphs=False)
    graph._graphs = GraphRunner(default_sizes(graph.max_batch_size), "emulate")
    prompts = _repetitive_prompts(24, 3, seed=5)
    for kw in (dict(temperature=0.0), dict(temperature=0.9, seed=[5, 6, 7])):
        a = eager.generate(prompts, max_new_tokens=24, **kw)
        b = graph.generate(prompts, max_new_tokens=24, **kw)
        assert a.token_ids == b.token_ids
        assert a.stats.num_accepted_tokens == b.stats.num_accepted_tokens
        assert 0 < _grafted(a.stats, spec) < a.stats.num_drafts * spec.prompt_lookup_num_tokens  # eager: cut
        assert b.stats.num_draft_tokens == b.stats.num_drafts * (spec.verify_tokens - 1)  # replayed: all M rows
    assert graph._graphs.replays >= 3 and not graph._graphs.failed


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_captured_round_with_lookup_has_no_host_sync(temperature):
    """The lookup and the graft are fixed-shape device work: a whole-cache round (what a CUDA graph
    captures) reads nothing back to the host (``test_cuda_graphs.py``'s detector)."""
    from test_cuda_graphs import _round_without_sync

    model, drafter = perm_pair("llama", vocab=24, seed=1, alpha=0.3)
    rt = runtime(model, drafter, spec=dataclasses.replace(SPECS["tree"], prompt_lookup_num_tokens=4), cuda_graphs=False)
    dec = _round_without_sync(rt, temperature)
    assert torch.equal(dec.out[:3], _round_without_sync(rt, temperature, detect=False).out[:3])


def test_sampled_tree_with_lookup_keeps_the_first_token_law():
    """Lossless sampling through the grafted tree: the first emitted token after a fixed prompt
    follows the target's distribution (chi-square over 600 seeded requests at a fixed budget)."""
    model, _ = perm_pair("llama", vocab=8, seed=7, alpha=0.9)
    drafter = ts.Eagle3Drafter.for_target(model.config, seed=8)  # random: the lookup's tokens are seldom its own
    prompt = list(range(8)) * 2 + [1, 2]  # every token occurs earlier: the lookup always proposes
    spec = dataclasses.replace(
        ts.SpecConfig(num_speculative_tokens=2, top_k=2, num_draft_tokens=4),
        prompt_lookup_num_tokens=3,
        prompt_lookup_min=1,
    )
    rt = runtime(model, drafter, spec, max_batch_size=4)
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / 0.9, -1)
    seeds = list(range(600))
    counts = torch.zeros(8, dtype=torch.float64)
    grafted = 0  # lookup nodes verified (rounds that drew on them), so the law is tested on grafted trees
    for i in range(0, len(seeds), 4):
        out = rt.generate([prompt] * 4, max_new_tokens=2, temperature=0.9, seed=seeds[i : i + 4])
        for t in out.token_ids:
            counts[t[1]] += 1  # the token after the first: decided by a verify round
        grafted += out.stats.num_draft_tokens - out.stats.num_drafts * (spec.num_draft_tokens - 1)
    assert grafted >= 300, grafted
    # the second token's law: sum over the first token of p(t1) p(t2 | t1), computed by the target
    law = torch.zeros(8, dtype=torch.float64)
    with torch.no_grad():
        for t1 in range(8):
            q = torch.softmax(model(torch.tensor([prompt + [t1]])).logits[0, -1].double() / 0.9, -1)
            law += p[t1] * q
    expected = law * len(seeds)
    keep = expected > 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum().item()
    assert chi2 < 24.3, (chi2, counts, expected)  # p = 0.001 at <= 7 degrees of freedom


# ================================================================== config and profiles


def test_spec_validation_and_profile_round_trip():
    with pytest.raises(ts.UserError, match="prompt_lookup_num_tokens=-1"):
        ts.SpecConfig(prompt_lookup_num_tokens=-1)
    with pytest.raises(ts.UserError, match="prompt_lookup_min"):
        ts.SpecConfig(prompt_lookup_max=2, prompt_lookup_min=3)
    s = ts.SpecConfig(4, 2, 8, prompt_lookup_num_tokens=6, prompt_lookup_max=2)
    assert (s.tree_depth, s.verify_tokens, s.label) == (6, 14, "(4,2,8)+lookup6")
    assert _read_spec(_spec_fields(s)) == s
    plain = ts.SpecConfig(4, 2, 8)
    assert sorted(_spec_fields(plain)) == sorted(["num_speculative_tokens", "top_k", "num_draft_tokens"])
    with pytest.raises(ValueError, match="optionally"):
        _read_spec(_spec_fields(plain) | {"lookup": 3})


def test_cli_flag_builds_the_shape():
    from tritonspec.cli.common import spec_from_flags

    assert spec_from_flags(3, 2, 6, 4) == ts.SpecConfig(3, 2, 6, prompt_lookup_num_tokens=4)
    assert spec_from_flags(None, None, None, None) is None
    assert spec_from_flags(3, 2, 6, None).prompt_lookup_num_tokens == 0
    one = spec_from_flags(3, 2, 6, 4, 1)  # --prompt-lookup-min 1
    assert one == ts.SpecConfig(3, 2, 6, prompt_lookup_num_tokens=4, prompt_lookup_min=1)
    assert one.label == "(3,2,6)+lookup4min1" and spec_from_flags(3, 2, 6, 4, 2).label == "(3,2,6)+lookup4"
    with pytest.raises(ts.UserError, match="needs a lookup branch"):
        spec_from_flags(3, 2, 6, None, 1)  # a minimum without a branch would be silently unused
    with pytest.raises(ts.UserError, match="prompt_lookup_min=4"):
        spec_from_flags(3, 2, 6, 4, 4)  # above prompt_lookup_max (3)


def test_generate_cli_runs_a_lookup_min_and_says_so(capsys):
    """``tritonspec generate --prompt-lookup-min 1`` runs the shape (its label in the stats line),
    with the same tokens as plain decoding (``--compare``)."""
    from tritonspec.cli import main

    flags = "--max-new-tokens 12 --num-speculative-tokens 2 --draft-top-k 1 --prompt-lookup-num-tokens 4"
    assert main(["generate", "--target", "demo", *flags.split(), "--prompt-lookup-min", "1", "--compare", "x = 1"]) == 0
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert "spec=(2,1,3)+lookup4min1 " in stats and "identical=True" in stats
    assert main(["generate", "--target", "demo", "--prompt-lookup-min", "1", "x = 1"]) == 2  # no branch to apply it to
    assert "needs a lookup branch" in capsys.readouterr().err


def test_eager_cpu_rounds_verify_only_the_grafted_nodes():
    """With little to look up, eager CPU rounds verify no padding nodes: after a one-token prompt
    the lookup can propose at most the root again (one node), not M."""
    model, drafter = perm_pair("llama", vocab=24, seed=8, alpha=0.3)
    spec = dataclasses.replace(SPECS["chain"], prompt_lookup_num_tokens=5)
    rt = runtime(model, drafter, spec)
    dec = rt.decoder
    for t in range(6):
        with torch.inference_mode():
            dec.prefill([[t]], speculative=True)
            tree = dec.draft()
        assert SPECS["chain"].num_draft_tokens <= tree.tokens.shape[1] <= SPECS["chain"].num_draft_tokens + 1
        assert dec.take_draft_nodes() == tree.tokens.shape[1] - 1  # what the stats count for this round
        assert dec.take_draft_nodes() == spec.verify_tokens - 1  # read once: a replayed round keeps the shape's


def test_lookup_at_the_cache_end_and_with_continuous_batching():
    """A lookup branch longer than the drafter's depth, rows that reach ``max_seq_len`` and rows
    refilled mid-run (each row's token history is its own): outputs equal plain decoding and the
    rows' solo runs."""
    model, drafter = perm_pair("llama", vocab=24, seed=4, alpha=0.9)
    rt = runtime(model, drafter, ts.SpecConfig(2, 1, 3, prompt_lookup_num_tokens=12), max_seq_len=40, max_batch_size=3)
    prompts = [[1, 2, 3, 4, 5] * 6, [7, 8, 9] * 9 + [1], [3]]
    out = rt.generate(prompts, max_new_tokens=100)
    assert out.token_ids == rt.generate(prompts, max_new_tokens=100, speculative=False).token_ids
    assert [len(p) + len(t) for p, t in zip(prompts, out.token_ids)] == [40, 40, 40]
    many = [[i % 5, (i + 1) % 7, 2, i % 5, (i + 1) % 7] * 3 for i in range(7)]
    out = rt.generate(many, max_new_tokens=12)
    assert out.stats.rows_refilled == 4
    assert out.token_ids == [rt.generate([p], max_new_tokens=12).token_ids[0] for p in many]
