"""The Triton backend plugs into the op layer with exactly the torch backend's signatures, and both
provide every method of the ``Ops`` protocol."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from tritonspec.kernels.triton_ops import TritonOps  # noqa: E402
from tritonspec.runtime.ops import Ops, TorchOps, get_ops  # noqa: E402

OPS = ["rms_norm", "aux_gather", "kv_write", "tree_attention", "verify_greedy", "verify_sampling", "kv_compact"]


@pytest.mark.parametrize("op", OPS)
def test_signatures_match_torch_ops(op):
    want = list(inspect.signature(getattr(TorchOps(), op)).parameters.values())  # bound: no ``self``
    got = list(inspect.signature(getattr(TritonOps(), op)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in got[: len(want)]] == [(p.name, p.kind, p.default) for p in want]
    for extra in got[len(want) :]:  # launcher-only knobs are keyword-only with defaults
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty


def _ops(cls) -> set[str]:
    """The op names of a backend class: its static and plain methods, private ones excluded."""
    return {
        k for k, v in vars(cls).items() if isinstance(v, staticmethod) or inspect.isfunction(v) if not k.startswith("_")
    }


def test_triton_ops_has_every_torch_op():
    torch_ops = _ops(TorchOps)
    assert set(OPS) <= torch_ops <= _ops(TritonOps)
    for op in torch_ops:  # same leading parameters, whichever ops exist now
        want = list(inspect.signature(getattr(TorchOps(), op)).parameters)
        assert list(inspect.signature(getattr(TritonOps(), op)).parameters)[: len(want)] == want, op


def test_ops_protocol_lists_every_backend_op():
    protocol = _ops(Ops)
    assert protocol == set(OPS) | {
        "begin_forward",
        "prefill_attention",
        "verify_chain",
        "linear",
        "rope",
        "argmax",
        "silu_mul",
    }
    assert _ops(TorchOps) == protocol  # no op a backend has that the protocol does not document


@pytest.mark.parametrize("cls", [TorchOps, TritonOps])
def test_backends_satisfy_the_ops_protocol(cls):
    ops = cls()
    assert isinstance(ops.name, str)
    for op in _ops(Ops):
        want = list(inspect.signature(getattr(Ops, op)).parameters.values())[1:]  # drop ``self``
        got = list(inspect.signature(getattr(ops, op)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got[: len(want)]] == [(p.name, p.kind, p.default) for p in want], (
            op
        )
        for extra in got[len(want) :]:
            assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty, op


def test_get_ops_triton():
    if not torch.cuda.is_available():
        assert __import__("os").environ.get("TRITON_INTERPRET") == "1"
    ops = get_ops("triton")
    assert isinstance(ops, TritonOps) and ops.name == "triton"


def test_every_op_runs_through_the_backend():
    ops = get_ops("triton")
    ref = TorchOps()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 32, device=dev)
    w = torch.randn(32, device=dev)
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), atol=1e-5)
    idx = torch.tensor([2, -1], device=dev)
    assert torch.allclose(
        ops.aux_gather(x, idx, w.view(2, 16), 1e-6), ref.aux_gather(x, idx, w.view(2, 16), 1e-6), atol=1e-5
    )
    tokens = torch.tensor([[4, 5, 6]], device=dev)
    parents = torch.tensor([[-1, 0, 1]], device=dev)
    argmax = torch.tensor([[5, 6, 7]], device=dev)
    for a, b in zip(ops.verify_greedy(tokens, parents, argmax, 2), ref.verify_greedy(tokens, parents, argmax, 2)):
        assert torch.equal(a, b)
