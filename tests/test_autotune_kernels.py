"""The kernel tuner end to end under the Triton interpreter (two-config lists), OutOfResources and
wrong-output candidates skipped, and the CLI's refusal to tune timings without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from tritonspec.autotune.kernel_tuner import KernelShape, Problem, format_results, tune_kernels, tune_problem  # noqa: E402
from tritonspec.kernels import store  # noqa: E402

CPU = torch.device("cpu")
TINY = KernelShape(
    "tiny",
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_layers=2,
    tree_tokens=4,
    context=32,
    max_depth=2,
)


def _fake_bench(times):
    def bench(fn, device):
        fn()
        return times[store._FORCED.get("rms_norm", {}).get("num_warps", 0)]

    return bench


def test_kernel_tuner_end_to_end_under_the_interpreter(tuned_dir):
    """Two candidates for rms_norm through the real launcher; the winner lands in the store and
    the launcher then runs it (the timings are rigged: the interpreter's wall clock is noise)."""
    from tritonspec.kernels.rms_norm import rms_norm, rms_norm_reference
    from tritonspec.kernels.utils import rms_config

    two = [{"num_warps": 1}, {"num_warps": 2}]
    results, files = tune_kernels(
        [TINY],
        torch.float32,
        CPU,
        ops=["rms_norm", "verify_greedy"],
        candidates={"rms_norm": two, "verify_greedy": two},
        out_dir=tuned_dir,
        bench=_fake_bench({0: 5.0, 1: 4.0, 2: 3.0}),
        show_progress=False,
    )
    r = {x.op: x for x in results}
    assert r["rms_norm"].best == {"num_warps": 2} and r["rms_norm"].value == 64 and r["rms_norm"].tried == 2
    assert r["rms_norm"].speedup == pytest.approx(5.0 / 3.0)
    names = sorted(f.name for f in files)
    assert names == ["rms_norm,device_name=cpu,dtype=float32.json", "verify_greedy,device_name=cpu,dtype=int64.json"]
    data = json.loads((tuned_dir / names[0]).read_text())
    assert data["configs"] == {"64": {"num_warps": 2}}  # keyed by hidden size only, never by a row count
    assert data["bucket"] == "hidden_size" and data["timings_us"]["64"] == {"default": 5.0, "best": 3.0}
    assert rms_config(64, torch.float32, CPU)[1] == 2
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.allclose(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), atol=1e-5)
    table = format_results(results)
    assert "rms_norm" in table and "hidden_size=64" in table and "w=2" in table


def test_real_timer_runs_and_dry_run_writes_nothing(tuned_dir):
    results, files = tune_kernels(
        [TINY],
        torch.float32,
        CPU,
        ops=["aux_gather"],
        candidates={"aux_gather": [{"num_warps": 1}, {"num_warps": 2}]},
        dry_run=True,
        out_dir=tuned_dir,
        show_progress=False,
    )
    assert files == [] and not tuned_dir.exists()
    assert results[0].best in ({"num_warps": 1}, {"num_warps": 2}) and results[0].best_us > 0


def test_out_of_resources_and_wrong_output_are_skipped():
    from triton.runtime.errors import OutOfResources

    def run():
        w = store._FORCED.get("rms_norm", {}).get("num_warps")
        if w == 8:
            raise OutOfResources(300000, 232448, "shared memory")
        return torch.ones(3) * (2.0 if w == 4 else 1.0)

    p = Problem("rms_norm", 64, run, [{"num_warps": 8}, {"num_warps": 4}, {"num_warps": 2}], exact=False)
    res = tune_problem(p, CPU, bench=lambda fn, dev: (fn(), 1.0 + store._FORCED["rms_norm"].get("num_warps", 9))[1])
    assert res.best == {"num_warps": 2}
    assert any("OutOfResources" in s for s in res.skipped) and any("differs" in s for s in res.skipped)


def test_heuristic_kept_when_it_is_fastest():
    p = Problem("rms_norm", 64, lambda: torch.ones(2), [{"num_warps": 2}], exact=True)
    res = tune_problem(p, CPU, bench=lambda fn, dev: 1.0 if not store._FORCED["rms_norm"] else 2.0)
    assert res.best == res.default == {"num_warps": 1} and res.best_us == 1.0


def test_cli_refuses_kernel_timing_without_a_gpu(monkeypatch, capsys):
    from tritonspec.cli import main

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["autotune", "kernels", "--dry-run"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_kernels_under_the_interpreter(tmp_path, capsys):
    from tritonspec.cli import main
    from tritonspec.runtime.tiny import tiny_random_pair

    if torch.cuda.is_available():
        pytest.skip("has a GPU: the CLI would tune for real")
    t, _ = tiny_random_pair(tmp_path / "pair")
    assert (
        main(
            [
                "autotune",
                "kernels",
                "--device",
                "cpu",
                "--shapes",
                str(t),
                "--ops",
                "rms_norm,verify_greedy",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "hidden_size=96" in out and "num_draft_tokens=48" in out and out.count("wrote ") == 2
    assert (tmp_path / "o" / "rms_norm,device_name=cpu,dtype=float32.json").exists()
