"""perf/gpu_check.py, the prepared GPU check: its plan (--dry-run) and the table it prints last,
checked without a GPU (the GPU run itself happens in a session that has one)."""

from __future__ import annotations

import json

import pytest
import torch

from _util import perf_module


@pytest.fixture(scope="module")
def gpu_check():
    return perf_module("gpu_check")


def test_dry_run_prints_every_step_and_runs_nothing(gpu_check, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_check.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "pip install -q --no-deps --no-build-isolation -e ." in text
    assert "tests/test_kernels_verify_sampling.py" in text and "tests/test_backend_triton.py" in text
    assert "perf/bench_kernels_verify_sampling.py" in text and "perf/bench_kernels_tree_attention.py" in text
    assert (
        f"--benchmark-json={tmp_path / 'out' / 'bench-bench_kernels_verify_sampling.json'}" in text
    )  # a part per file
    assert "copy baseline" in text and "% of copy GB/s" in text
    assert "tests/test_cuda_graphs.py" in text and "perf/bench_graphs.py" in text and "projected" in text
    assert f"--benchmark-json={tmp_path / 'out' / 'graphs.json'}" in text
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    gpu_check.main(["--dry-run", "--skip-install", "--skip-tests", "--bench", "perf/bench_kernels_verify.py"])
    text = capsys.readouterr().out
    assert "pip install" not in text and "tests/test_kernels" not in text and "bench_kernels_rms_norm" not in text


def test_table_from_benchmark_json(gpu_check):
    bench = {
        "benchmarks": [
            {
                "name": "test_rms_norm[triton-60-True]",
                "extra_info": {
                    "provider": "triton",
                    "rows": 60,
                    "hidden": 4096,
                    "residual": True,
                    "dtype": "torch.bfloat16",
                    "device": "NVIDIA H200",
                    "us_per_call": 4.2,
                    "us_per_call_graph": 2.1,
                    "bytes": 1966080,
                    "gbps": 468.1,
                    "gbps_graph": 936.2,
                    "timestamp": "x",
                },
            },
            {
                "name": "test_verify_sampling[torch-8]",
                "extra_info": {
                    "provider": "torch",
                    "batch": 8,
                    "us_per_call": 1234.5,
                    "gbps": 0.5,
                    "graph_error": "RuntimeError: x",
                },
            },
            {"name": "test_no_info", "extra_info": {}},
        ]
    }
    rows = gpu_check.table_rows(bench, copy_gbps=4000.0)
    assert [r["op"] for r in rows] == ["rms_norm[triton-60-True]", "verify_sampling[torch-8]"]
    assert rows[0]["shape"] == "rows=60 hidden=4096 residual=True dtype=torch.bfloat16"
    assert rows[0]["pct_copy"] == pytest.approx(100 * 468.1 / 4000.0)
    table = gpu_check.format_table(rows, dict(gbps=4000.0, mib=1024, device="NVIDIA H200"))
    lines = table.splitlines()
    assert lines[0] == (
        "| op | shape | us/call | us/call in a graph | GB/s | GB/s in a graph | % of copy GB/s | % in a graph |"
    )
    shape = "rows=60 hidden=4096 residual=True dtype=torch.bfloat16"
    assert lines[2] == f"| rms_norm[triton-60-True] | {shape} | 4.2 | 2.1 | 468 | 936 | 11.7 | 23.4 |"
    assert lines[3] == "| verify_sampling[torch-8] | batch=8 | 1234 | - | 0.5 | - | 0.0125 | - |"
    assert lines[4] == "- verify_sampling[torch-8]: not captured (RuntimeError: x)"
    assert "copy baseline: 4000.0 GB/s (1024 MiB" in table
    assert gpu_check.table_rows({}, None) == []
    assert "not measured" in gpu_check.format_table([], None)


def test_copy_baseline_and_a_benchmark_end_to_end(gpu_check, tmp_path, monkeypatch, capsys):
    """The non-dry path on this machine: one small benchmark file, the copy baseline, the table."""
    monkeypatch.setenv("OUT", str(tmp_path))
    row = {"pair": "old", "mode": "plain", "runner": "eager", "batch": 1, "tokens_s": 1.0, "round_ms": 1.0}
    (tmp_path / "graphs.json").write_text(json.dumps({"benchmarks": [{"name": "x", "extra_info": row}]}))  # stale
    rc = gpu_check.main(
        [
            "--skip-install",
            "--skip-tests",
            "--skip-graphs",
            "--bench",
            "perf/bench_kernels_verify.py",
            "--budget-s",
            "300",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["copy"]["gbps"] > 0 and summary["steps"] == [
        dict(step="bench:verify", rc=0, wall_s=summary["steps"][0]["wall_s"])
    ]
    assert (tmp_path / "bench.json").exists() and not list(tmp_path.glob("bench-*.json"))  # parts merged
    assert {r["op"] for r in summary["rows"]} >= {"verify_greedy[torch-1]", "verify_greedy[torch-8]"}
    assert "copy baseline:" in text
    assert text.rstrip().splitlines()[-1].startswith("graphs vs eager: no rows")
    assert (tmp_path / "summary.md").read_text().count("| verify_greedy[torch-") == 2


def test_graph_table_and_projection(gpu_check):
    def row(pair, mode, runner, batch, tok_s, tau, round_ms, launches=None):
        info = dict(pair=pair, mode=mode, runner=runner, batch=batch, tokens_s=tok_s, tau=tau, round_ms=round_ms)
        info |= dict(draft_ms=1.0, verify_ms=2.0, commit_ms=0.5, launches=launches, aten_ops=2080)
        return {"name": "x", "extra_info": info}

    graphs = {
        "benchmarks": [
            row("demo", "speculative", "eager", 1, 100.0, 3.5, 10.0, 900),
            row("demo", "speculative", "graphs", 1, 150.0, 3.5, 6.0),
            row("llama3-8b-random", "plain", "graphs", 1, 140.0, 1.0, 7.0),
            row("llama3-8b-random", "speculative", "graphs", 1, 60.0, 1.02, 14.0),
            {"name": "other", "extra_info": {}},
        ]
    }
    rows = gpu_check.graph_rows(graphs)
    assert len(rows) == 4 and rows[0]["launches"] == 900
    table = gpu_check.format_graph_table(rows)
    assert "| demo | speculative | eager | 1 | 100.0 | 3.50 | 10.00 | 1.00 | 2.00 | 0.50 | 900 | 2080 |" in table
    assert "demo speculative batch 1: graphs 1.50x eager tokens/s" in table
    # projected = tau(demo, graphs) x plain round / speculative round = 3.5 x 7 / 14
    assert "PROJECTED llama3-8b speedup, batch 1: τ 3.50" in table and "= 1.75x (projected, not measured" in table
    assert gpu_check.format_graph_table([]).startswith("graphs vs eager: no rows")


def test_a_killed_benchmark_file_loses_only_its_own_rows(gpu_check, tmp_path):
    """A step killed at its timeout leaves an empty (or cut) JSON part: the merge skips it and keeps
    the other files' rows (run 1 on the H200 crashed on an empty bench.json and printed no table)."""
    good = {"benchmarks": [{"name": "test_x", "extra_info": {"us_per_call": 1.0, "gbps": 2.0}}]}
    (tmp_path / "bench-a.json").write_text(json.dumps(good))
    (tmp_path / "bench-b.json").write_text("")
    (tmp_path / "bench-c.json").write_text('{"benchmarks": [{"na')
    merged = gpu_check.merge_bench_parts(tmp_path)
    assert [b["name"] for b in merged["benchmarks"]] == ["test_x"]
    assert json.loads((tmp_path / "bench.json").read_text()) == merged and not list(tmp_path.glob("bench-*"))
    assert gpu_check.read_json(tmp_path / "missing.json") == {}


def test_graph_table_reports_the_deterministic_cost(gpu_check):
    def row(runner, tok_s):
        info = dict(pair="p", mode="plain", runner=runner, batch=1, tokens_s=tok_s, tau=1.0, round_ms=1.0)
        return {"name": "x", "extra_info": info | dict(draft_ms=0, verify_ms=1, commit_ms=0, launches=1, aten_ops=1)}

    rows = gpu_check.graph_rows({"benchmarks": [row("eager", 10.0), row("graphs", 40.0), row("graphs-det", 30.0)]})
    table = gpu_check.format_graph_table(rows)
    assert "- p plain batch 1: graphs 4.00x eager tokens/s" in table
    assert "- p plain batch 1: deterministic 0.75x default tokens/s (both with graphs)" in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: perf/conftest.py's graph_time captures a CUDA graph")
def test_graph_time_times_a_capturable_call_and_reports_one_that_is_not():
    mod = perf_module("conftest", "perf_conftest")
    x = torch.randn(1 << 20, device="cuda")
    ok = mod.graph_time(lambda: x.mul_(1.0), inner=10)
    assert ok["us_per_call_graph"] > 0 and "graph_error" not in ok
    before = torch.cuda.current_stream()
    bad = mod.graph_time(lambda: float(x.sum()), inner=3)  # a host read: not capturable
    assert "us_per_call_graph" not in bad and "graph_error" in bad
    assert torch.cuda.current_stream() == before  # the caller's stream is current again
    assert torch.randn(8, device="cuda").isfinite().all()  # the generator left capture mode
