"""The command line: generate (tiny random pair, explicit directories, stdin), export, bench, error reporting."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.runtime.tiny import tiny_random_pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return tiny_random_pair(tmp_path_factory.mktemp("pair"))


def test_generate_prints_text_and_stats(pair_dirs, capsys):
    t, d = pair_dirs
    flags = "--max-new-tokens 12 --num-speculative-tokens 3 --draft-top-k 2 --num-draft-tokens 6 --compare"
    assert main(["generate", "--target", str(t), "--drafter", str(d), *flags.split(), "def f(x):"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    stats = out[-1]
    assert stats.startswith("[tritonspec] new_tokens=12 tokens/s=")
    assert "mean_acceptance_length=" in stats and "identical=True" in stats and "speedup=" in stats


def test_partial_shape_flags():
    from tritonspec.cli.common import spec_from_flags as _spec_from_flags

    assert _spec_from_flags(None, None, None) is None  # the tuned profile, else the defaults
    assert _spec_from_flags(None, 1, None) == ts.SpecConfig.chain(6)  # "--draft-top-k 1" alone is a chain
    assert _spec_from_flags(3, None, None) == ts.SpecConfig(3, 8, 48)
    assert _spec_from_flags(2, 2, None) == ts.SpecConfig(2, 2, 7)  # capped at what the shape drafts
    assert _spec_from_flags(None, None, 20) == ts.SpecConfig(6, 8, 20)


def test_generate_cuda_graphs_flag(pair_dirs, capsys):
    t, d = pair_dirs
    args = ["generate", "--target", str(t), "--drafter", str(d), "--max-new-tokens", "6", "def f(x):"]
    assert main(args + ["--cuda-graphs", "off"]) == 0
    assert "cuda_graphs=off" in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="cuda_graphs=True needs a CUDA device"):
            assert main(args + ["--cuda-graphs", "on"]) == 0
        assert "cuda_graphs=off" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(args + ["--cuda-graphs", "maybe"])


def test_stats_line_names_the_cpu_kernels(pair_dirs, capsys):
    """The stats line says whether the row-invariant CPU kernels ran (``--cpu-linear``)."""
    from tritonspec.kernels import cpu_linear

    t, d = pair_dirs
    args = ["generate", "--target", str(t), "--drafter", str(d), "--max-new-tokens", "4", "def f(x):"]
    assert main(args + ["--cpu-linear", "torch"]) == 0
    assert "cpu_kernels=off" in capsys.readouterr().out
    assert main(args) == 0
    want = "on" if cpu_linear.available(torch.float32) is None else "off"
    assert f"cpu_kernels={want}" in capsys.readouterr().out
    # bfloat16: weights packed for AMX where it runs, else into panels on AVX2 (kernels/cpu/linear.c), else as loaded
    assert main(args + ["--dtype", "bfloat16"]) == 0
    panels = cpu_linear.panels_default(torch.bfloat16) and cpu_linear.available(torch.bfloat16) is None
    layout = "amx" if cpu_linear.amx_available() is None else "panels" if panels else "nk"
    assert f"weight_layout={layout}" in capsys.readouterr().out


def test_generate_reads_stdin_and_runs_plain(pair_dirs, capsys, monkeypatch):
    t, _ = pair_dirs
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\n"))
    assert main(["generate", "--target", str(t), "--max-new-tokens", "5"]) == 0
    assert "mode=plain" in capsys.readouterr().out


def test_generate_bad_input_is_a_clear_error(pair_dirs, capsys, tmp_path):
    t, d = pair_dirs
    assert main(["generate", "--target", str(tmp_path), "x"]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert main(["generate", "--target", str(t), "--max-new-tokens", "0", "x"]) == 2
    assert "max_new_tokens=0 must be >= 1" in capsys.readouterr().err


def test_export_to_speculators(pair_dirs, tmp_path, capsys):
    t, d = pair_dirs
    argv = ["export", "--drafter", str(d), "--out", str(tmp_path / "s"), "--format", "speculators", "--target", str(t)]
    assert main([*argv, "--for", "vllm"]) == 0  # the speculators format records the target (verifier)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["fc_norm"] is True
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(t.resolve())
    e = ts.Eagle3Drafter.from_pretrained(tmp_path / "s")
    assert e.config == ts.Eagle3Drafter.from_pretrained(d).config


def test_generate_stream_and_sampling_flags(pair_dirs, capsys):
    t, d = pair_dirs
    flags = "--max-new-tokens 10 --num-speculative-tokens 2 --draft-top-k 2 --num-draft-tokens 4 --temperature 0.7"
    args = ["generate", "--target", str(t), "--drafter", str(d), *flags.split(), "--seed", "5", "x = "]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    assert plain.splitlines()[0] == streamed.splitlines()[0]  # same seed, same text, streamed or not
    assert "new_tokens=10" in streamed.splitlines()[-1]
    assert main(args + ["--top-p", "0"]) == 2
    assert "top_p=0.0 must lie in (0, 1]" in capsys.readouterr().err


def test_bench_prints_a_side_by_side_table(pair_dirs, tmp_path, capsys):
    t, d = pair_dirs
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n')
    prompts = str(tmp_path / "p.jsonl")
    flags = "--systems ours-plain,hf-greedy,ours-eagle3.1 --num-prompts 1 --max-new-tokens 6 --max-seq-len 256"
    assert main(["bench", "--target", str(t), "--drafter", f"eagle3.1={d}", "--prompts", prompts, *flags.split()]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:6] == ["set", "T", "B", "system", "tok/s", "speedup"]
    assert [ln.split()[3] for ln in lines[1:]] == ["ours-plain", "hf-greedy", "ours-eagle3.1"]
    assert lines[1].split()[5] == "1.00x"
    assert main(["bench", "--target", str(t), "--systems", "nope"]) == 2


def test_only_user_errors_become_one_line_messages(monkeypatch, capsys):
    import tritonspec.cli.export as export

    def fail(exc):
        def cmd(args):
            raise exc

        return cmd

    argv = ["export", "--drafter", "d", "--out", "o"]
    for exc in (ValueError("bad value"), FileNotFoundError("no such file"), NotImplementedError("not yet")):
        monkeypatch.setattr(export, "cmd_export", fail(exc))
        assert main(argv) == 2
        assert capsys.readouterr().err == f"tritonspec export: error: {exc}\n"
    for exc in (KeyError("bug"), TypeError("bug")):  # bugs keep their traceback
        monkeypatch.setattr(export, "cmd_export", fail(exc))
        with pytest.raises(type(exc)):
            main(argv)


def test_generate_a_prompts_file_continuously_batched(pair_dirs, capsys, tmp_path):
    """--prompts-file: one JSON line per prompt, in order, each equal to that prompt's solo run;
    5 prompts on 2 rows refill 3 finished rows."""
    t, d = pair_dirs
    prompts = ["def f(x):", "import os\\nimport sys", "class A:", "x = [1, 2", "for i in range(3):"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n\n")
    argv = [
        "generate",
        "--target",
        str(t),
        "--drafter",
        str(d),
        "--max-new-tokens",
        "6",
        *"--num-speculative-tokens 3 --draft-top-k 2 --num-draft-tokens 6".split(),
    ]
    assert main([*argv, "--prompts-file", str(f), "--max-batch-size", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    recs = [json.loads(line) for line in lines[:-1]]
    assert [r["index"] for r in recs] == list(range(5)) and "rows_refilled=3 rows_moved=" in lines[-1]
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, spec=ts.SpecConfig(3, 2, 6), max_batch_size=1)
    for r, p in zip(recs, prompts):
        assert r["token_ids"] == rt.generate(p.replace("\\n", "\n"), max_new_tokens=6).token_ids[0]
    j = tmp_path / "budgets.jsonl"  # a record's own max_new_tokens; the others get --max-new-tokens
    rows = [{"prompt": "def g():", "max_new_tokens": 2}, {"prompt": "class B:"}]
    rows.append({"prompt": "x = 1", "max_new_tokens": 9})
    j.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*argv, "--prompts-file", str(j), "--max-batch-size", "2"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[:-1]]
    for r, p, n in zip(recs, ["def g():", "class B:", "x = 1"], [2, 6, 9]):
        assert r["token_ids"] == rt.generate(p, max_new_tokens=n).token_ids[0]
    assert [len(r["token_ids"]) for r in recs] == [2, 6, 9]
    j.write_text('{"prompt": "def g():", "max_new_tokens": 0}\n')
    assert main([*argv, "--prompts-file", str(j)]) == 2
    assert '"max_new_tokens" must be an integer >= 1, not 0' in capsys.readouterr().err
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "def g():"}\n{"prompt": 3}\n')
    assert main([*argv, "--prompts-file", str(j)]) == 2
    assert "line 2: expected" in capsys.readouterr().err
    assert main([*argv, "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([*argv, "--prompts-file", str(f), "x"]) == 2
    assert "not both" in capsys.readouterr().err
