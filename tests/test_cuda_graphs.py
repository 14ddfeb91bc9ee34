"""CUDA-graph decode rounds (runtime/graphs.py).

On the CPU: the round (``Decoder.round``, the function that is captured on a GPU) has
no host synchronisation; and a replay emulator (``make_fx``: record the round's aten ops once,
replay only those, Python does not run again) reproduces eager output bit for bit through
batch buckets, padding, shrinking and growth, greedy and sampled. An inverse test shows the
emulator catches a round that leans on host state. On a GPU: real CUDA-graph replay equals eager.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tritonspec as ts
from tritonspec.runtime.decode import Decoder
from tritonspec.runtime.graphs import MAX_GRAPHS, GraphRunner, default_sizes, graph_runner

from _util import perm_pair, random_prompts, runtime

CUDA = torch.cuda.is_available()
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "item",
    "equal",
    "is_nonzero",
}


def _pair(vocab=24, seed=1):
    return perm_pair("llama", vocab=vocab, seed=seed, alpha=0.3)


def _emulated(model, drafter, sizes=None, **kw):
    rt = runtime(model, drafter, cuda_graphs=False, **kw)
    rt._graphs = GraphRunner(sizes or default_sizes(rt.max_batch_size), "emulate")
    return rt


class _NoSync(TorchDispatchMode):
    """Fails on any aten op that would read a device value back to the host on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensor_repeats = name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
        host_data = name == "lift_fresh" and args[0].dim() > 0  # torch.tensor(host list): a host->device copy
        bool_index = name in ("index", "index_put", "index_put_") and any(  # x[mask]: its size is data-dependent
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        )
        if name in SYNC_OPS or host_data or bool_index or (tensor_repeats and not (kwargs or {}).get("output_size")):
            raise AssertionError(f"host synchronisation in the decode round: aten.{name}")
        return func(*args, **(kwargs or {}))


def _round_without_sync(rt, temperature, speculative=True, fail_on=None, detect=True):
    from tritonspec.runtime.sampling import SamplingParams

    sp = SamplingParams(temperature=temperature)
    prompts = random_prompts(24, [5, 9, 3], seed=0)
    dec = rt.decoder
    with torch.inference_mode():
        dec.prefill(prompts, speculative=speculative, sampling=sp, seeds=[1, 2, 3], rows=4)
        readers = {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu", "numpy")}  # device -> host reads

        def refuse(m):
            def read(*a, **k):
                raise AssertionError(f"host synchronisation in the decode round: Tensor.{m}")

            return read

        # torch.tensor / as_tensor of host data, a 0-dim one included, is a host->device copy on a GPU,
        # which a CUDA graph cannot capture (torch.tensor(-inf, device=...) broke deterministic rounds'
        # capture on the H200); at dispatch level its 0-dim form looks like ``x[i] = 0``, so refuse the call
        makers = {m: getattr(torch, m) for m in ("tensor", "as_tensor")}

        def refuse_maker(m):
            def make(*a, **k):
                raise AssertionError(f"host data copied to the device in the decode round: torch.{m}")

            return make

        if detect:
            for m in readers:
                setattr(torch.Tensor, m, refuse(m))
            for m in makers:
                setattr(torch, m, refuse_maker(m))
        try:
            with _NoSync() if detect else contextlib.nullcontext():
                dec.round(whole_cache=True)
                if fail_on is not None:
                    fail_on(dec)
        finally:
            for m, f in readers.items():
                setattr(torch.Tensor, m, f)
            for m, f in makers.items():
                setattr(torch, m, f)
    return dec


@pytest.mark.parametrize("shape", [(3, 2, 6), (3, 1, 4)], ids=["tree", "chain"])  # chain at T > 0: sampled drafts
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("speculative", [True, False])
def test_round_has_no_host_sync(temperature, speculative, shape):
    model, drafter = _pair()
    rt = runtime(model, drafter, spec=ts_spec(*shape), cuda_graphs=False)
    out = _round_without_sync(rt, temperature, speculative).out[:3].clone()
    # the watched round is the real one: the same emitted tokens and counts as an unwatched round
    assert torch.equal(out, _round_without_sync(rt, temperature, speculative, detect=False).out[:3])
    depth = rt.spec.num_draft_tokens - 1 if rt.spec.top_k == 1 else rt.spec.num_speculative_tokens
    depth = depth if speculative else 0
    count = out[:, depth + 1]
    assert ((count >= 0) & (count <= depth)).all()
    assert all(0 <= t < 24 for b in range(3) for t in out[b, : int(count[b]) + 1].tolist())


def test_deterministic_gpu_branch_round_has_no_host_sync(monkeypatch):
    """Deterministic mode's GPU branch (every linear through the batch-invariant matmul, the kernel
    RMSNorm, ``kernels.det_attention``) run here with torch stand-ins for its Triton kernels: its round
    must be capturable too. On the H200 (2026-12-04) it was not: a ``torch.tensor(-inf, device=...)``
    in the attention of then (``chunked_attention``) was a host-to-device copy. The stand-in replaces
    only the attention's launch: its launcher's checks and the per-forward ``tree_order`` run as on a GPU."""
    from tritonspec.kernels import det_attention as da

    model, drafter = _pair()
    rt = runtime(model, drafter, spec=ts_spec(3, 2, 6), cuda_graphs=False, deterministic=True, cpu_linear="torch")
    inner = rt.ops.ops
    rt.ops._gpu = (inner.linear, inner.rms_norm)  # the branch taken on a CUDA device
    rt.ops._det = da
    calls = []

    def launch(q, k, v, pre, slots, counts, scale, ns, q_offset, causal):  # no kernel: zeros, after its checks
        calls.append(causal)
        return torch.zeros_like(q)

    monkeypatch.setattr(da, "_launch", launch)
    _round_without_sync(rt, 0.0)
    assert True in calls and False in calls  # the prompt (causal) and the round (tree) took the GPU branch


def test_recorded_generation_runs_eagerly_beside_graphs():
    """``generate_recorded`` (audit, deterministic tests) reads the host every round: on a graph runtime
    those rounds must run eagerly (a replay would skip the recorder, a capture would fail), and the
    graphs are back afterwards. Emulated replay here; on the H200 the recorder made captures fail."""
    from tritonspec.runtime.audit import generate_recorded

    model, drafter = _pair()
    spec = ts_spec(3, 2, 6)
    eager = runtime(model, drafter, spec=spec, cuda_graphs=False)
    graph = _emulated(model, drafter, spec=spec)
    prompts = random_prompts(24, [5, 9, 2], seed=4)
    want_t, want_l = generate_recorded(eager, prompts, max_new_tokens=16)
    assert graph.generate(prompts, max_new_tokens=16).token_ids == want_t  # captures, then replays
    runner, replays = graph._graphs, graph._graphs.replays
    assert replays > 0
    got_t, got_l = generate_recorded(graph, prompts, max_new_tokens=16)
    assert got_t == want_t and all(torch.equal(a, b) for a, b in zip(got_l, want_l))
    assert all(len(lg) == len(t) for lg, t in zip(got_l, got_t))
    assert graph._graphs is runner and runner.replays == replays and not runner.failed  # eager, no capture tried
    assert graph.generate(prompts, max_new_tokens=16).token_ids == want_t and runner.replays > replays
    ops = graph.decoder.ops
    with pytest.raises(ts.UserError):  # a request that fails inside generate: the decoder's ops come back
        generate_recorded(graph, prompts, max_new_tokens=16, temperature=-1.0)
    assert graph.decoder.ops is ops


def test_sync_detector_catches_item_and_tolist():  # inverse: the detector is not vacuous
    model, drafter = _pair()
    rt = runtime(model, drafter, spec=ts_spec(3, 2, 6), cuda_graphs=False)
    with pytest.raises(AssertionError, match="aten.(item|_local_scalar_dense)"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: int(st.L[0]))
    with pytest.raises(AssertionError, match="tolist"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: st.L.tolist())
    with pytest.raises(AssertionError, match="torch.tensor"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: st.L.add_(torch.tensor(st.lengths[: st.rows])))
    with pytest.raises(AssertionError, match="aten.index"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: st.L[st.active])
    with pytest.raises(AssertionError, match="aten.equal"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: torch.equal(st.L, st.root))
    with pytest.raises(AssertionError, match="Tensor.cpu"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: st.L.cpu())
    with pytest.raises(AssertionError, match="torch.tensor"):
        _round_without_sync(rt, 0.0, fail_on=lambda st: st.L.add_(torch.tensor(1, device=st.L.device)))


def ts_spec(d, k, n):
    from tritonspec import SpecConfig

    return SpecConfig(num_speculative_tokens=d, top_k=k, num_draft_tokens=n)


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "T0.9": dict(temperature=0.9),
    "T0.9-top_p-top_k": dict(temperature=0.9, top_p=0.9, top_k=5),
}


@pytest.mark.parametrize("spec", [(3, 2, 6), (4, 1, 5)], ids=["tree", "chain"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_emulated_replay_equals_eager(spec, sampling):
    model, drafter = _pair()
    eager = runtime(model, drafter, spec=ts_spec(*spec), cuda_graphs=False)
    graph = _emulated(model, drafter, spec=ts_spec(*spec))
    prompts = random_prompts(24, [5, 9, 2], seed=4)  # 3 rows: bucket 4, one idle padding row
    temperature = SAMPLING[sampling]["temperature"]
    kw = dict(max_new_tokens=24, seed=[5, 6, 7], **SAMPLING[sampling])
    a, b = eager.generate(prompts, **kw), graph.generate(prompts, **kw)
    assert b.token_ids == a.token_ids and b.finish_reasons == a.finish_reasons
    assert b.stats.num_accepted_tokens == a.stats.num_accepted_tokens
    g = graph._graphs
    assert g.captures >= 1 and g.replays >= 3 and not g.failed
    assert {k[0] for k in g.graphs} <= {4, 2, 1}
    if temperature == 0.0:  # lossless through graphs: speculative == plain greedy
        assert b.token_ids == graph.generate(prompts, max_new_tokens=24, speculative=False).token_ids


def test_emulated_buckets_shrink_and_grow():
    """Rows that finish at the end of the batch move the round to a smaller bucket; a later,
    larger batch uses a larger bucket; every output equals eager."""
    model, drafter = _pair()
    spec = ts_spec(3, 2, 6)
    eager = runtime(model, drafter, spec=spec, cuda_graphs=False, max_seq_len=40, max_batch_size=8)
    graph = _emulated(model, drafter, spec=spec, max_seq_len=40, max_batch_size=8)
    # longer prompts hit max_seq_len sooner; in plain decoding (one token per round) the last rows
    # finish first: 4 rows -> bucket 2 -> bucket 1
    prompts = random_prompts(24, [3, 5, 20, 30], seed=9)
    for batch in (prompts, prompts[:1], prompts + random_prompts(24, [4], seed=2)):
        for speculative in (True, False):
            kw = dict(max_new_tokens=40, speculative=speculative)
            a, b = eager.generate(batch, **kw), graph.generate(batch, **kw)
            assert b.token_ids == a.token_ids and b.finish_reasons == a.finish_reasons
    plain = {k[0] for k in graph._graphs.graphs if not k[1]}
    assert {4, 2, 1, 8} <= plain, plain  # shrink within a batch; 1 prompt; 5 prompts -> bucket 8
    assert {4, 1, 8} <= {k[0] for k in graph._graphs.graphs if k[1]}
    assert not graph._graphs.failed


def test_emulator_catches_host_state_in_the_round(monkeypatch):
    """Inverse: a round that takes positions from the host-side lengths is right eagerly but wrong
    when replayed (the host values are frozen into the graph); the emulator shows it."""
    model, drafter = _pair()
    spec = ts_spec(3, 2, 6)
    eager = runtime(model, drafter, spec=spec, cuda_graphs=False)
    graph = _emulated(model, drafter, spec=spec)
    prompts = random_prompts(24, [5, 9], seed=4)
    want = eager.generate(prompts, max_new_tokens=20).token_ids
    orig = Decoder.verify

    def host_positions(self, tree, **kw):
        frozen = torch.tensor(self.lengths[: self.rows], device=self.device)  # host state: baked in at capture
        self.L.copy_(torch.where(self.active, frozen, self.L))
        return orig(self, tree, **kw)

    monkeypatch.setattr(Decoder, "verify", host_positions)
    assert eager.generate(prompts, max_new_tokens=20).token_ids == want  # eagerly still right
    assert graph.generate(prompts, max_new_tokens=20).token_ids != want  # replayed: wrong


def test_capture_failure_warns_and_runs_eager(monkeypatch):
    model, drafter = _pair()
    spec = ts_spec(3, 2, 6)
    eager = runtime(model, drafter, spec=spec, cuda_graphs=False)
    graph = _emulated(model, drafter, spec=spec)

    def boom(fn, state):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph._graphs, "_capture", boom)
    prompts = random_prompts(24, [5, 9], seed=4)
    with pytest.warns(UserWarning, match="capture failed for batch bucket 2"):
        out = graph.generate(prompts, max_new_tokens=20)
    assert out.token_ids == eager.generate(prompts, max_new_tokens=20).token_ids
    assert graph._graphs.failed and not graph._graphs.graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failed key stays eager, without a new warning
        assert graph.generate(prompts, max_new_tokens=20).token_ids == out.token_ids


def test_rounds_beyond_the_buckets_run_eager_with_one_warning():
    model, drafter = _pair()
    spec = ts_spec(3, 2, 6)
    eager = runtime(model, drafter, spec=spec, cuda_graphs=False)
    graph = _emulated(model, drafter, spec=spec, sizes=[1, 2])
    prompts = random_prompts(24, [5, 9, 4], seed=4)
    with pytest.warns(UserWarning, match=r"3 rows exceeds the captured CUDA-graph batch sizes \[1, 2\]"):
        out = graph.generate(prompts, max_new_tokens=16)
    assert out.token_ids == eager.generate(prompts, max_new_tokens=16).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph.generate(prompts, max_new_tokens=4)
    assert all(k[0] <= 2 for k in graph._graphs.graphs)


def test_graph_keys_follow_sampling_settings():
    model, drafter = _pair()
    graph = _emulated(model, drafter, spec=ts_spec(3, 2, 6))
    prompts = random_prompts(24, [5], seed=4)
    graph.generate(prompts, max_new_tokens=8)
    graph.generate(prompts, max_new_tokens=8, temperature=0.7, seed=1)
    graph.generate(prompts, max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1)
    assert len(graph._graphs.graphs) == 3


def test_runner_buckets_and_limits():
    assert default_sizes(1) == [1] and default_sizes(8) == [1, 2, 4, 8] and default_sizes(6) == [1, 2, 4, 6]
    r = GraphRunner([4, 1, 2, 2], "emulate")
    assert r.sizes == [1, 2, 4] and [r.bucket(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    calls = []
    for i in range(MAX_GRAPHS):
        r.graphs[(1, i)] = object()
    with pytest.warns(UserWarning, match="further settings run eagerly"):
        assert r.run((1, "new"), lambda: calls.append(1), []) is False
    assert calls == []


def test_options_are_validated():
    model, drafter = _pair()
    with pytest.raises(ValueError, match="cuda_graphs='yes'"):
        runtime(model, drafter, cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"cuda_graph_sizes=\[0, 2\]"):
        runtime(model, drafter, cuda_graph_sizes=[0, 2])
    with pytest.raises(ValueError, match="max_batch_size=8"):
        runtime(model, drafter, cuda_graph_sizes=[16])
    with pytest.raises(ValueError, match="graph backend"):
        GraphRunner([1], "hip")
    if not CUDA:
        with pytest.warns(UserWarning, match="cuda_graphs=True needs a CUDA device"):
            rt = runtime(model, drafter, cuda_graphs=True)
        assert rt._graphs is None and rt.warmup() == []
        assert runtime(model, drafter)._graphs is None  # "auto" on a CPU: eager, silently
    assert graph_runner(False, torch.device("cuda"), 4, None) is None


def test_cuda_branch_against_a_fake_torch_cuda(monkeypatch):
    """The CUDA path of the runner, driven by a recording stand-in for ``torch.cuda``: warm-up and
    capture on the side stream inside the runtime's device, capture bracketed by begin/end with the
    shared pool, replay inside the device, and after a failed capture the caller's stream is
    current again and the key stays eager."""
    import contextlib

    log, current = [], []

    class Stream:
        def __init__(self, device=None, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    current.append(Stream(name="default"))

    @contextlib.contextmanager
    def stream(s):
        prev, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = prev

    @contextlib.contextmanager
    def device(d):
        log.append(("device", str(d)))
        yield

    class Graph:
        fail = False

        def capture_begin(self, pool=None):
            log.append(("begin", current[0].name, pool))

        def capture_end(self):
            log.append(("end", current[0].name))
            if Graph.fail:
                Graph.fail = False  # one capture fails; the recovery capture after it completes
                raise RuntimeError("operation failed due to a previous error during capture")

        def replay(self):
            log.append(("replay", current[0].name))

    pools = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))  # no CUDA here
    for name, value in dict(
        Stream=Stream,
        stream=stream,
        device=device,
        CUDAGraph=Graph,
        current_stream=lambda device=None: current[0],
        graph_pool_handle=lambda: f"pool{len(pools)}" if pools.append(1) is None else "",
        synchronize=lambda device=None: log.append(("sync",)),
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    r = GraphRunner([1, 2], "cuda", torch.device("cuda", 1))
    ran = []
    assert r.run((1, "a"), lambda: ran.append(current[0].name), []) is True
    assert ran == ["side", "side"]  # the eager warm-up, then the capture, both on the side stream
    begin, end = log.index(("begin", "side", "pool1")), log.index(("end", "side"))
    assert begin < end and ("device", "cuda:1") in log and current[0].name == "default"
    assert log[-1] == ("wait", "default", "side")
    log.clear()
    assert r.run((1, "a"), lambda: ran.append("again"), []) is True
    assert log == [("device", "cuda:1"), ("replay", "default")] and ran[-1] != "again"
    Graph.fail = True
    with pytest.warns(UserWarning, match="capture failed for batch bucket 2"):
        assert r.run((2, "b"), lambda: ran.append(current[0].name), []) is True
    assert current[0].name == "default" and (2, "b") in r.failed and ("sync",) in log
    # the recovery: a capture that completes (resetting the generators) and a fresh pool for the next
    failed_end = log.index(("end", "side"))
    assert ("begin", "side", "pool3") in log[failed_end:] and log.count(("end", "side")) == 2
    log.clear()
    assert r.run((4, "c"), lambda: None, []) is False  # 4 rows: no bucket
    r.sizes.append(4)
    assert r.run((4, "c"), lambda: None, []) is True and ("begin", "side", "pool2") in log
    assert (4, "c") not in r.failed
    assert r.run((2, "b"), lambda: None, []) is False
    Graph.fail = False  # an error inside the round is the one reported, and capture still ends

    def bad():
        if len(log) and log[-1][0] == "begin":
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(UserWarning, match="bucket 1 .*operation not permitted when stream is capturing"):
        assert r.run((1, "c"), bad, []) is True
    assert log[-1] in (("sync",), ("end", "default")) and ("end", "side") in log and current[0].name == "default"


def test_torch_ops_mask_cache_is_per_forward():
    """The round updates the lengths in place; a new forward must not reuse the old mask
    (inverse: without ``begin_forward`` the stale mask is served). The SDPA path (the CPU attention
    kernel reads the lengths at each call and caches nothing)."""
    from tritonspec.kernels.tree_attention import tree_attention_reference
    from tritonspec.runtime.ops import TorchOps

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2, 8, generator=g)
    k, v = torch.randn(1, 12, 2, 8, generator=g), torch.randn(1, 12, 2, 8, generator=g)
    lens, mask = torch.tensor([3]), torch.ones(1, 2, 2, dtype=torch.bool).tril()
    ops = TorchOps("torch")
    ops.begin_forward()
    ops.tree_attention(q, k, v, lens, mask, 0.3, 10)
    lens.add_(4)
    want = tree_attention_reference(q, k, v, lens, mask, 0.3, 10)
    stale = ops.tree_attention(q, k, v, lens, mask, 0.3, 10)
    assert not torch.allclose(stale, want)
    ops.begin_forward()
    assert torch.allclose(ops.tree_attention(q, k, v, lens, mask, 0.3, 10), want, atol=1e-6)


# ---------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not CUDA, reason="no GPU: CUDA-graph capture and replay need a CUDA device")


def _cuda_pair():
    model, drafter = _pair(vocab=24, seed=1)
    return model, drafter


@gpu
@pytest.mark.parametrize("spec", [(3, 2, 6), (4, 1, 5)], ids=["tree", "chain"])  # chain at T > 0: sampled drafts
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_gpu_graph_replay_equals_eager(sampling, spec):
    """Triton backend (the GPU default): its kernels are bit-identical whatever the batch rows or
    the attention-length hint, so eager (live rows, host-bounded lengths) and replay (bucket rows,
    whole cache) must give the same tokens."""
    model, drafter = _cuda_pair()
    spec = ts_spec(*spec)
    kw = dict(spec=spec, device="cuda", dtype=torch.float32, backend="triton")
    eager = runtime(model, drafter, cuda_graphs=False, **kw)
    graph = runtime(model, drafter, cuda_graphs=True, **kw)
    prompts = random_prompts(24, [5, 9, 2], seed=4)
    temperature = SAMPLING[sampling]["temperature"]
    gen = dict(max_new_tokens=24, seed=[5, 6, 7], **SAMPLING[sampling])
    a, b = eager.generate(prompts, **gen), graph.generate(prompts, **gen)
    assert b.token_ids == a.token_ids
    assert graph._graphs.captures >= 1 and graph._graphs.replays >= 3 and not graph._graphs.failed
    if temperature == 0.0:
        assert b.token_ids == graph.generate(prompts, max_new_tokens=24, speculative=False).token_ids
        assert b.token_ids == eager.generate(prompts, max_new_tokens=24, speculative=False).token_ids


@gpu
def test_gpu_buckets_shrink_grow_and_warmup():
    model, drafter = _cuda_pair()
    spec = ts_spec(3, 2, 6)
    kw = dict(spec=spec, device="cuda", dtype=torch.float32, max_seq_len=40, max_batch_size=8)
    eager = runtime(model, drafter, cuda_graphs=False, **kw)
    graph = runtime(model, drafter, cuda_graphs=True, **kw)
    assert graph.warmup([1, 2]) == [1, 2]
    n0 = graph._graphs.captures
    assert n0 >= 2
    prompts = random_prompts(24, [3, 5, 20, 30], seed=9)
    for batch in (prompts, prompts[:1], prompts + random_prompts(24, [4], seed=2)):
        for speculative in (True, False):
            kw = dict(max_new_tokens=40, speculative=speculative)
            assert graph.generate(batch, **kw).token_ids == eager.generate(batch, **kw).token_ids
    assert {4, 2, 1, 8} <= {k[0] for k in graph._graphs.graphs if not k[1]}
    assert not graph._graphs.failed


@gpu
def test_gpu_failed_capture_falls_back_on_the_right_stream():
    """A round that synchronises cannot be captured: the runner warns, the round it ran eagerly
    counts, and the caller's stream is current again (``torch.cuda.graph`` would leave its capture
    stream current when ``capture_end`` raises)."""
    r = GraphRunner([1, 2], "cuda", torch.device("cuda"))
    x = torch.zeros(4, device="cuda")
    before = torch.cuda.current_stream()

    def bad_round():
        x.add_(1)
        float(x.sum())  # a host read: illegal while capturing

    with pytest.warns(UserWarning, match="capture failed for batch bucket 1"):
        assert r.run((1, "k"), bad_round, [x]) is True
    assert torch.cuda.current_stream() == before
    assert x.tolist() == [1.0] * 4  # the warm-up ran once; the capture ran nothing
    assert r.run((1, "k"), bad_round, [x]) is False and (1, "k") in r.failed
    torch.cuda.synchronize()
    # what the failed capture left behind is undone: random ops run (the generator's capture flag
    # is reset) and a later capture succeeds (a fresh memory pool)
    assert torch.randn(8, device="cuda").isfinite().all()

    def good_round():
        x.add_(torch.rand(4, device="cuda"))

    assert r.run((2, "k"), good_round, [x]) is True and (2, "k") not in r.failed and r.captures == 1
    assert r.run((2, "k"), good_round, [x]) is True and r.replays == 1
    assert torch.randn(8, device="cuda").isfinite().all()


def test_graphs_follow_a_shared_cache_that_grows():
    """Two runtimes on one target: the second needs a larger cache, which moves it; the first
    runtime's graphs pointed at the old cache, so they are dropped and recaptured (with stale
    graphs the emulated replay would write into the old cache and the output would go wrong)."""
    from tritonspec.runtime.target import TargetModel

    model, drafter = _pair()
    tm = TargetModel.from_pretrained(model)
    prompts = random_prompts(24, [5, 9], seed=4)
    small = ts_spec(3, 2, 6)
    want = runtime(model, drafter, spec=small, cuda_graphs=False).generate(prompts, max_new_tokens=20).token_ids
    import tritonspec as ts

    a = ts.SpeculativeRuntime(tm, drafter, spec=small, max_batch_size=4, max_seq_len=160, cuda_graphs=False)
    a._graphs = GraphRunner(default_sizes(4), "emulate")
    assert a.generate(prompts, max_new_tokens=20).token_ids == want
    before = tm.k_cache
    b = ts.SpeculativeRuntime(tm, drafter, spec=ts_spec(4, 4, 40), max_batch_size=8, max_seq_len=160, cuda_graphs=False)
    b.generate(prompts, max_new_tokens=8)
    assert tm.k_cache is not before and tm.k_cache.shape[1] == 8  # the cache grew (and moved)
    captures = a._graphs.captures
    assert a.generate(prompts, max_new_tokens=20).token_ids == want
    assert a._graphs.captures > captures  # recaptured against the new cache
    where = a._graph_addresses()
    d = a.drafter  # the module a's graphs point at (a converted copy when the caller's borrows another embedding)
    d.rope(d.rope().cos.shape[0] + 64)  # a runtime with a longer drafter context regrows the tables
    assert a._graph_addresses() != where  # ... which the next round notices
