"""Continuous batching (``SpeculativeRuntime._decode``, ``Decoder.admit``).

More prompts than ``max_batch_size``: a finished row is refilled with the next waiting prompt at
the next round, from anywhere in the batch. Every prompt's output equals its solo run, greedy and
seeded sampling, speculative and plain, eager and through the graph-replay emulator; an inverse
test shows the comparison catches an admission that gets a row's random stream wrong.
"""

from __future__ import annotations

import pytest
import torch

import tritonspec as ts
from tritonspec.runtime.audit import generate_recorded
from tritonspec.runtime.decode import Decoder
from tritonspec.runtime.graphs import GraphRunner
from tritonspec.runtime.sampling import SamplingParams

from _util import perm_pair, random_prompts, runtime

SPEC = ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6)
STOP = 5  # a token the perm pair emits now and then: rows stop at different rounds
LENGTHS = [3, 17, 8, 1, 11, 6, 2, 25, 9, 4, 13, 7, 1, 19, 5, 10, 3, 14, 8, 2, 16, 6]  # 22 ragged prompts


@pytest.fixture(scope="module")
def pair():
    return perm_pair("llama", vocab=24, seed=3, alpha=0.4)


def _solo(rt, prompts, **kw):
    seeds = kw.pop("seed", None)
    return [rt.generate([p], seed=None if seeds is None else seeds[i], **kw) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [True, False])
def test_outputs_equal_solo_runs(pair, batch, temperature, speculative):
    rt = runtime(*pair, SPEC, max_batch_size=batch)
    prompts = random_prompts(24, LENGTHS, seed=11)
    kw = dict(max_new_tokens=24, temperature=temperature, speculative=speculative, stop_token_ids=[STOP])
    seeds = list(range(100, 100 + len(prompts)))
    out = rt.generate(prompts, seed=seeds, **kw)
    solo = _solo(rt, prompts, seed=seeds, **kw)
    assert out.token_ids == [s.token_ids[0] for s in solo]
    assert out.finish_reasons == [s.finish_reasons[0] for s in solo]
    assert set(out.finish_reasons) == {"stop", "length"}  # rows really end at different rounds
    assert out.stats.rows_refilled == len(prompts) - batch
    assert out.stats.num_new_tokens == sum(len(t) for t in out.token_ids)
    # greedy tokens are blind to the drafter's state (verification is lossless): its acceptance is
    # not, so a newcomer drafting from a stale or misplaced drafter state shows up here
    for field in ("num_drafts", "num_accepted_tokens", "accepted_per_position"):
        solo_sum = [getattr(s.stats, field) for s in solo]
        total = [sum(x) for x in zip(*solo_sum)] if isinstance(solo_sum[0], list) else sum(solo_sum)
        assert getattr(out.stats, field) == total, field


BUDGETS = [5, 24, 1, 13, 30, 2, 9, 17, 4, 21, 7, 11, 3, 26, 8, 15, 6, 19, 10, 2, 12, 28]  # one per prompt


@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [True, False])
def test_per_prompt_budgets_equal_solo_runs(pair, batch, temperature, speculative):
    """``max_new_tokens`` one per prompt (vLLM's per-request ``max_tokens``): each output equals its solo run
    with its own budget, rows without a stop end exactly at theirs, and a row whose budget runs out is
    refilled while longer ones keep decoding."""
    rt = runtime(*pair, SPEC, max_batch_size=batch)
    prompts = random_prompts(24, LENGTHS, seed=11)
    kw = dict(temperature=temperature, speculative=speculative, stop_token_ids=[STOP])
    seeds = list(range(100, 100 + len(prompts)))
    out = rt.generate(prompts, max_new_tokens=BUDGETS, seed=seeds, **kw)
    solo = [rt.generate([p], max_new_tokens=n, seed=s, **kw) for p, n, s in zip(prompts, BUDGETS, seeds)]
    assert out.token_ids == [s.token_ids[0] for s in solo]
    assert out.finish_reasons == [s.finish_reasons[0] for s in solo]
    lengths = [len(t) for t in out.token_ids]
    assert all(n <= b for n, b in zip(lengths, BUDGETS))
    ran_out = [n == b for n, b, r in zip(lengths, BUDGETS, out.finish_reasons) if r == "length"]
    assert ran_out and all(ran_out)  # a "length" row stopped at its own budget, not another row's
    assert len(set(lengths)) > 5
    assert out.stats.rows_refilled == len(prompts) - batch


def test_per_prompt_budgets_are_checked(pair):
    rt = runtime(*pair, SPEC, max_batch_size=2)
    prompts = random_prompts(24, [3, 4, 5], seed=1)
    with pytest.raises(ts.UserError, match="2 max_new_tokens values for 3 prompts"):
        rt.generate(prompts, max_new_tokens=[4, 5])
    with pytest.raises(ts.UserError, match=r"max_new_tokens=0 \(prompt 1\) must be >= 1"):
        rt.generate(prompts, max_new_tokens=[4, 0, 5])
    with pytest.raises(ts.UserError, match="must be an integer"):
        rt.generate(prompts, max_new_tokens=[4, 2.5, 5])
    with pytest.raises(ts.UserError, match="must be an integer"):
        rt.generate(prompts, max_new_tokens="8")
    same = rt.generate(prompts, max_new_tokens=torch.tensor([6, 6, 6])).token_ids
    assert same == rt.generate(prompts, max_new_tokens=6).token_ids


def prefill_rows(rt, monkeypatch) -> list[int]:
    """A list that records the rows of each prompt forward ``rt``'s target runs from now on."""
    rows: list[int] = []
    forward = rt.decoder.target.forward

    def counted(ops, tokens, meta, *a, **k):
        if meta.prefill:
            rows.append(tokens.shape[0])
        return forward(ops, tokens, meta, *a, **k)

    monkeypatch.setattr(rt.decoder.target, "forward", counted)
    return rows


@pytest.mark.parametrize("spec", [SPEC, ts.SpecConfig.chain(3)])  # a tree, and sampled chains at temperature 1
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("lengths, forwards", [([150, 9, 40], [1, 1, 1]), ([90, 88, 93], [3])])
def test_a_ragged_batch_prefills_prompt_by_prompt(pair, monkeypatch, temperature, lengths, forwards, spec):
    """On a CPU a batch whose padding would be much of its prompt forward runs each prompt alone
    (``PREFILL_SPLIT_PAD``): one target forward per prompt, each of one row, and every output is
    still its solo run's (greedy and seeded sampling, speculative and plain). The inverse: prompts
    of about one length run one forward of all rows."""
    rt = runtime(*pair, spec, max_batch_size=3, max_seq_len=200)
    prompts = random_prompts(24, lengths, seed=12)
    kw = dict(max_new_tokens=16, temperature=temperature, stop_token_ids=[])
    seeds = [7, 8, 9]
    rows = prefill_rows(rt, monkeypatch)
    for speculative in (True, False):
        rows.clear()
        out = rt.generate(prompts, seed=seeds, speculative=speculative, **kw)
        assert rows == forwards
        solo = _solo(rt, prompts, seed=seeds, speculative=speculative, **kw)
        assert out.token_ids == [s.token_ids[0] for s in solo]
        if speculative:  # the drafter's state after the prompt too: acceptance as in the solo runs
            assert out.stats.num_accepted_tokens == sum(s.stats.num_accepted_tokens for s in solo)


@pytest.mark.parametrize("split_tokens, forwards", [(256, [1, 1, 1]), (280, [3])])
def test_a_large_batch_prefills_prompt_by_prompt(pair, monkeypatch, split_tokens, forwards):
    """Prompts of about one length also run one at a time once the batch holds ``PREFILL_SPLIT_TOKENS``
    padded tokens (3 x 93 = 279 here; their activations would fall out of the caches), and each output is
    still its solo run's; the inverse: a batch just under the bound runs one forward."""
    from tritonspec.runtime import decode

    monkeypatch.setattr(decode, "PREFILL_SPLIT_TOKENS", split_tokens)
    rt = runtime(*pair, SPEC, max_batch_size=3, max_seq_len=200)
    prompts = random_prompts(24, [90, 88, 93], seed=12)
    rows = prefill_rows(rt, monkeypatch)
    out = rt.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    assert rows == forwards
    assert out.token_ids == [s.token_ids[0] for s in _solo(rt, prompts, max_new_tokens=12, stop_token_ids=[])]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculative", [True, False])
def test_the_last_running_row_moves_into_a_finished_one_and_the_round_narrows(pair, temperature, speculative):
    """No prompt waits (a static batch) and a row below running ones stops: the last running row moves
    into it (``Decoder.move_row``: caches, buffers, random stream), the round narrows to the rows still
    decoding, and every output and the acceptance are the solo runs' (a row moved without its drafter
    cache or its random stream would show in the acceptance or the sampled tokens)."""
    rt = runtime(*pair, SPEC, max_batch_size=4)
    prompts = random_prompts(24, [5, 12, 7, 9], seed=0)  # rows 2 and 3 stop first, then rows 0 and 1 run on
    kw = dict(max_new_tokens=24, temperature=temperature, speculative=speculative, stop_token_ids=[STOP])
    seeds = [1, 2, 3, 4]
    dec, rows = rt.decoder, []
    real_round = dec.round

    def counted(*a, **k):
        rows.append(dec.rows)
        return real_round(*a, **k)

    dec.round = counted
    try:
        out = rt.generate(prompts, seed=seeds, **kw)
    finally:
        del dec.round
    solo = _solo(rt, prompts, seed=seeds, **kw)
    assert out.token_ids == [s.token_ids[0] for s in solo]
    assert out.stats.rows_moved > 0 and rows[0] == 4 and min(rows) < 4
    if speculative:
        assert out.stats.num_accepted_tokens == sum(s.stats.num_accepted_tokens for s in solo)
        assert out.stats.accepted_per_position == [sum(x) for x in zip(*(s.stats.accepted_per_position for s in solo))]


def test_move_row_copies_every_piece_of_a_rows_state(pair):
    """``Decoder.move_row``: the destination holds what the source held (every buffer row, both caches'
    committed slots), the source idles (L 0, inactive), and a bad move is refused."""
    rt = runtime(*pair, SPEC, max_batch_size=3)
    dec = rt.decoder
    with torch.inference_mode():
        sampling = SamplingParams(temperature=1.0)
        dec.prefill(random_prompts(24, [5, 12, 7], seed=4), speculative=True, sampling=sampling, seeds=[1, 2, 3])
        for _ in range(2):
            dec.round()
            dec.collect()
        n = dec.lengths[2]
        t = rt.target
        want = (
            [b[2].clone() for b in dec.bufs.tensors()]
            + [c[:, 2, :n].clone() for c in (t.k_cache, t.v_cache)]
            + [c[2, :n].clone() for c in (dec.draft_cache.k, dec.draft_cache.v)]
        )
        assert all(w.abs().sum() > 0 for w in want[-4:])  # caches filled: the comparison below is not vacuous
        dec.finish([0])
        with pytest.raises(ValueError, match="running row after a finished one"):
            dec.move_row(0, 1)
        dec.move_row(2, 0)
        got = (
            [b[0] for b in dec.bufs.tensors()]
            + [c[:, 0, :n] for c in (t.k_cache, t.v_cache)]
            + [c[0, :n] for c in (dec.draft_cache.k, dec.draft_cache.v)]
        )
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), i
        assert dec.running == [True, True, False] and dec.lengths[0] == n and dec.lengths[2] == 0
        assert int(dec.bufs.L[2]) == 0 and not bool(dec.bufs.active[2])


def test_the_audit_recorder_sees_a_ragged_batch_in_one_prefill(pair):
    """``generate_recorded`` (an ops proxy that reads the prefill's head rows as the batch's) keeps the
    one padded prefill: every prompt's recorded logits pick its emitted tokens."""
    rt = runtime(*pair, SPEC, max_batch_size=3, max_seq_len=200)
    prompts = random_prompts(24, [150, 9, 40], seed=12)
    tokens, logits = generate_recorded(rt, prompts, max_new_tokens=6, stop_token_ids=[])
    assert [len(t) for t in tokens] == [6, 6, 6]
    assert [lg.argmax(-1).tolist() for lg in logits] == tokens


def test_a_row_finishing_mid_batch_is_reused(pair, monkeypatch):
    """Rows leave from anywhere: a prompt is admitted into a row below a row still decoding."""
    admitted: list[tuple[int, list[bool]]] = []
    real = Decoder.admit

    def spy(self, slot, prompt, seed=0, **kw):
        admitted.append((slot, list(self.running)))
        return real(self, slot, prompt, seed, **kw)

    monkeypatch.setattr(Decoder, "admit", spy)
    rt = runtime(*pair, SPEC, max_batch_size=4)
    prompts = random_prompts(24, LENGTHS, seed=11)
    out = rt.generate(prompts, max_new_tokens=24, stop_token_ids=[STOP])
    assert len(admitted) == out.stats.rows_refilled == len(prompts) - 4
    below_a_live_row = [s for s, running in admitted if any(running[s + 1 :])]
    assert below_a_live_row, admitted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replayed_rounds_equal_eager_through_growing_and_shrinking_rows(pair, monkeypatch, temperature):
    """The round's rows shrink when the last rows finish and widen again when a newcomer lands
    above the live rows (buckets 1-4): replayed rounds follow, with the same tokens as eager ones."""
    widths: list[int] = []
    real = Decoder.narrow
    monkeypatch.setattr(Decoder, "narrow", lambda self, rows: (widths.append(rows), real(self, rows))[1])
    prompts = random_prompts(24, LENGTHS[:16], seed=5)
    kw = dict(max_new_tokens=20, stop_token_ids=[STOP, 7, 11], temperature=temperature, seed=list(range(16)))
    eager = runtime(*pair, SPEC, max_batch_size=4, cuda_graphs=False).generate(prompts, **kw)
    rt = runtime(*pair, SPEC, max_batch_size=4, cuda_graphs=False)
    rt._graphs = GraphRunner([1, 2, 3, 4], "emulate")
    widths.clear()
    replayed = rt.generate(prompts, **kw)
    assert replayed.token_ids == eager.token_ids
    assert replayed.stats.time_split_s["graph"] > 0
    assert any(b > a for a, b in zip(widths[1:], widths[2:])), widths  # a round widened after a shrink


def test_deterministic_mode_keeps_batch_invariance(pair):
    rt = runtime(*pair, SPEC, max_batch_size=3, deterministic=True)
    prompts = random_prompts(24, LENGTHS[:9], seed=2)
    for temperature in (0.0, 0.8):
        kw = dict(max_new_tokens=16, temperature=temperature, stop_token_ids=[STOP])
        out = rt.generate(prompts, seed=7, **kw)
        assert out.token_ids == [s.token_ids[0] for s in _solo(rt, prompts, seed=[7] * 9, **kw)]


def test_newcomers_that_stop_at_their_first_token(pair):
    rt = runtime(*pair, SPEC, max_batch_size=2)
    prompts = random_prompts(24, [4, 9, 2, 7, 3], seed=1)
    out = rt.generate(prompts, max_new_tokens=1)
    assert [len(t) for t in out.token_ids] == [1] * 5 and out.stats.rows_refilled == 3
    assert out.token_ids == [rt.generate([p], max_new_tokens=1).token_ids[0] for p in prompts]


def test_a_wrong_random_stream_is_caught(pair, monkeypatch):
    """Inverse: admitting a row with another seed changes its sampled tokens, and the solo
    comparison sees it (so the equality above is not vacuous)."""
    real = Decoder.admit
    monkeypatch.setattr(
        Decoder, "admit", lambda self, slot, prompt, seed=0, **kw: real(self, slot, prompt, seed + 1, **kw)
    )
    rt = runtime(*pair, SPEC, max_batch_size=2)
    prompts = random_prompts(24, LENGTHS[:6], seed=4)
    kw = dict(max_new_tokens=24, temperature=1.0)
    out = rt.generate(prompts, seed=list(range(6)), **kw)
    solo = [s.token_ids[0] for s in _solo(rt, prompts, seed=list(range(6)), **kw)]
    assert out.token_ids[:2] == solo[:2]  # the first batch is not admitted
    assert out.token_ids[2:] != solo[2:]


def test_admit_refuses_a_busy_row(pair):
    rt = runtime(*pair, SPEC, max_batch_size=2)
    dec = rt.decoder
    with torch.inference_mode():
        dec.prefill([[1, 2, 3]], speculative=True, rows=2)
        with pytest.raises(ValueError, match="row 0 is still decoding"):
            dec.admit(0, [4, 5])
        with pytest.raises(ValueError, match="slot=2 is outside"):
            dec.admit(2, [4, 5])
        assert dec.admit(1, [4, 5]) >= 0 and dec.running == [True, True]


def test_static_batch_only_paths_refuse_more_prompts_up_front(pair):
    """Observed decoding and the audit's logit recorder keep per-row records: they refuse more
    prompts than rows before any work, instead of failing at the first refill."""

    class Noop:
        def wrap(self, ops):
            return ops

        def on_catch_up(self, *a):
            pass

        on_depth1 = on_step = on_catch_up

    rt = runtime(*pair, SPEC, max_batch_size=2)
    prompts = random_prompts(24, [3, 4, 5], seed=0)
    with rt.observe(Noop()), pytest.raises(ts.UserError, match="3 prompts exceed max_batch_size=2"):
        rt.generate(prompts, max_new_tokens=4)
    with pytest.raises(ts.UserError, match="3 prompts exceed max_batch_size=2"):
        generate_recorded(rt, prompts, max_new_tokens=4)
    assert (
        generate_recorded(rt, prompts[:2], max_new_tokens=4)[0] == rt.generate(prompts[:2], max_new_tokens=4).token_ids
    )


def test_a_deeper_tree_set_after_construction_still_retires_rows(pair):
    """A deeper spec than the runtime was built with re-makes the decode buffers at the next
    prefill, which runs in inference mode; retiring rows between rounds (outside it) still writes
    them. Found by perf/bench_defaults.py: inference tensors refused the in-place write."""
    rt = runtime(*pair, ts.SpecConfig.chain(1), max_batch_size=3)
    prompts = random_prompts(24, [5, 9, 3, 7], seed=2)
    kw = dict(max_new_tokens=12, stop_token_ids=[STOP])
    rt.spec = ts.SpecConfig(num_speculative_tokens=5, top_k=2, num_draft_tokens=9)
    out = rt.generate(prompts, **kw)
    assert not rt.decoder.bufs.out.is_inference()
    assert out.token_ids == [s.token_ids[0] for s in _solo(rt, prompts, speculative=False, **kw)]
