"""The public decode-step object (runtime/decode.py): its steps, driven by hand, give what
``generate`` gives; ``collect`` keeps the host lengths equal to the device lengths; snapshots
restore a step exactly; drafting another shape leaves the runtime's spec alone."""

from __future__ import annotations

import pytest
import torch

import tritonspec as ts
from tritonspec.runtime.decode import DraftTree, Verification
from tritonspec.runtime.sampling import SamplingParams

from _util import perm_pair, random_prompts, runtime


def _rt(spec=(3, 2, 6)):
    model, drafter = perm_pair("llama", vocab=24, seed=2, alpha=0.3)
    return runtime(model, drafter, ts.SpecConfig(*spec), cuda_graphs=False)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_steps_by_hand_equal_generate(speculative, temperature):
    rt = _rt()
    prompts = random_prompts(24, [5, 9, 1], seed=7)
    want = rt.generate(
        prompts, max_new_tokens=12, temperature=temperature, seed=[3, 4, 5], stop_token_ids=(), speculative=speculative
    ).token_ids
    dec = rt.decoder
    outs = [[] for _ in prompts]
    with torch.inference_mode():
        dec.prefill(prompts, speculative=speculative, sampling=SamplingParams(temperature=temperature), seeds=[3, 4, 5])
        for b, t in enumerate(dec.first_tokens()):
            outs[b].append(t)
        while min(len(o) for o in outs) < 12:
            tree = dec.draft() if speculative else dec.root_tree()
            assert isinstance(tree, DraftTree)
            v = dec.verify(tree)
            assert isinstance(v, Verification) and v.num.shape == (3,)
            dec.commit(tree, v)
            for b, toks in enumerate(dec.collect()):
                outs[b] += toks
            assert dec.lengths == dec.L.tolist(), "host lengths follow the device lengths"
    assert [o[:12] for o in outs] == want


def test_round_equals_its_steps_and_finish_retires_rows():
    rt = _rt()
    prompts = random_prompts(24, [4, 6], seed=1)
    dec = rt.decoder
    with torch.inference_mode():
        dec.prefill(prompts, speculative=True)
        snap = dec.snapshot()
        tree = dec.draft()
        dec.commit(tree, dec.verify(tree))
        by_steps = [t.clone() for t in (dec.L, dec.root, dec.hn, dec.carry, dec.out)]
        dec.restore(snap)
        assert torch.equal(dec.L, snap.tensors[0]) and dec.lengths == snap.lengths
        dec.round()
        for a, b in zip(by_steps, (dec.L, dec.root, dec.hn, dec.carry, dec.out)):
            assert torch.equal(a, b)
        new = dec.collect()
        assert [len(t) for t in new] == [int(n) + 1 for n in dec.out[:, dec.emitted_width - 1]]
        dec.finish([0])
        assert dec.running == [False, True] and dec.lengths[0] == 0 and int(dec.L[0]) == 0
        assert not bool(dec.active[0])
        dec.round()
        assert dec.collect()[0] == [], "a retired row emits nothing"


def test_draft_with_another_shape_leaves_the_spec_alone():
    rt = _rt(spec=(3, 2, 6))
    dec = rt.decoder
    with torch.inference_mode():
        dec.prefill(random_prompts(24, [5], seed=2), speculative=True)
        tree = dec.draft(ts.SpecConfig(2, 1, 3))
    assert tree.tokens.shape == (1, 3) and tree.max_depth == 2
    assert rt.spec == ts.SpecConfig(3, 2, 6) and dec.spec is rt.spec
    with pytest.raises(ValueError, match="needs a drafter"):
        runtime(perm_pair("llama", vocab=24, seed=2)[0]).decoder.prefill([[1, 2]], speculative=True)


@pytest.mark.parametrize("lookup", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_top1_tree_drafted_as_a_chain_is_the_tree(lookup, temperature):
    """A top-1 tree keeping every candidate (``K = 1``, ``N - 1 = D``) is drafted as a chain without the
    tree's frontier bookkeeping: the same tree (tokens, parents, depths, mask) and the same drafter
    state as the general expansion, round after round, greedy and sampled (tree verification at 0.9:
    ``sample_chain_drafts`` off), with and without a lookup branch."""
    spec = ts.SpecConfig(4, 1, 5, prompt_lookup_num_tokens=lookup, sample_chain_drafts=False)
    model, drafter = perm_pair("llama", vocab=24, seed=2, alpha=0.3)
    rt = runtime(model, drafter, spec, cuda_graphs=False)
    prompts = random_prompts(24, [5, 9, 3], seed=4)
    dec = rt.decoder
    chains = []
    real_chain = dec.draft_chain
    dec.draft_chain = lambda *a, **k: chains.append(1) or real_chain(*a, **k)  # the chain path really runs
    with torch.inference_mode():
        dec.prefill(prompts, speculative=True, sampling=SamplingParams(temperature=temperature), seeds=[1, 2, 3])
        for _ in range(6):
            snap = dec.snapshot()
            cache = [t.clone() for t in (dec.draft_cache.k, dec.draft_cache.v)]
            dec.top1_chains = False
            general = dec.draft()
            state = [t.clone() for t in (dec.draft_cache.k, dec.draft_cache.v)]
            dec.restore(snap)
            for t, c in zip((dec.draft_cache.k, dec.draft_cache.v), cache):  # the chain writes every slot itself
                t.copy_(c)
            dec.top1_chains = True
            before = len(chains)
            chain = dec.draft()
            assert len(chains) == before + 1, "the top-1 tree was not drafted as a chain"
            for name in ("tokens", "parents", "depth", "mask"):
                assert torch.equal(getattr(chain, name), getattr(general, name)), name
            assert chain.max_depth == general.max_depth
            assert all(torch.equal(a, b) for a, b in zip(state, (dec.draft_cache.k, dec.draft_cache.v)))
            dec.commit(chain, dec.verify(chain))
            dec.collect()
    assert int(chain.parents[0, 1:5].eq(torch.arange(4)).all()), "a chain below the root"


def test_the_catch_up_reencodes_up_to_the_longest_path_only_on_row_invariant_kernels(monkeypatch):
    """Where the drafter's projections run packed on the CPU kernel, a catch-up cut to the longest
    accepted path leaves the state of every row as the full-width one does, bit for bit; where a
    projection stays unpacked (``F.linear`` rounds by row count: Intel's size floors) it is not cut."""
    from tritonspec.kernels import cpu_linear as cl

    shapes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    model, drafter = perm_pair("llama", vocab=32, seed=2, alpha=0.3, target_overrides=shapes)  # N % 16 == 0: packed
    rt = runtime(model, drafter, ts.SpecConfig(4, 1, 5, prompt_lookup_num_tokens=3), cuda_graphs=False)
    dec = rt.decoder
    prompts = random_prompts(32, [5, 9, 3], seed=4)
    cut = 0
    with torch.inference_mode():
        if not dec._row_invariant_drafter():
            pytest.skip("the drafter's projections do not all run packed on the CPU kernel here (no AVX2/AVX-512)")
        dec.prefill(prompts, speculative=True)
        for _ in range(6):
            tree = dec.draft()
            v = dec.verify(tree)
            B, N = tree.tokens.shape
            index = torch.where(v.nodes >= 0, torch.arange(B)[:, None] * N + v.nodes, -1)
            n_valid = torch.where(dec.active, v.num + 1, 0)
            q = int(n_valid.max())
            states = []
            for width in (index.shape[1], q):
                snap = dec.snapshot()
                dec._catch_up(v.aux.reshape(B * N, -1), index[:, :width], v.emitted[:, :width].clamp(min=0),
                              n_valid, dec.L, dec._kv_len(False, tree.max_depth + 1))  # fmt: skip
                kv = [c[:, :-1].clone() for c in (dec.draft_cache.k, dec.draft_cache.v)]  # the trash slot aside
                states.append([dec.hn.clone(), dec.carry.clone(), *kv])
                dec.restore(snap)
            cut += q < index.shape[1]
            assert all(torch.equal(a, b) for a, b in zip(*states))
            dec.commit(tree, v)
            dec.collect()
    assert cut, "no round had a shorter accepted path: the comparison was vacuous"
    monkeypatch.setattr(cl, "panels_pay", lambda w: False)  # the projections stay [N, K]: F.linear may run them
    dec.drafter.pack_for_cpu()
    with torch.inference_mode():
        assert not dec._row_invariant_drafter()
