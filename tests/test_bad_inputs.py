"""Bad inputs, table-driven, over the Python API and the command line (issue 14): each raises the
library's ``UserError`` (a ``ValueError``; a missing path stays ``FileNotFoundError``) whose message
names the offending value; on the command line each exits with status 2 and one line on stderr,
never a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tritonspec as ts
from tritonspec.cli import main

pytestmark = pytest.mark.skipif(not ts.demo.available(), reason="the bundled demo pair is not built")
NO_CUDA = not torch.cuda.is_available()
PROMPT = "import os\n"


@pytest.fixture(scope="module")
def rt():
    return ts.SpeculativeRuntime.from_pretrained(*ts.demo_pair(), max_batch_size=4, max_seq_len=256)


@pytest.fixture(scope="module")
def bad_target(tmp_path_factory):
    """The demo target with an lm_head of 4,000 rows for its vocabulary of 4,096."""
    src, _ = ts.demo_pair()
    dst = tmp_path_factory.mktemp("bad") / "target"
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"][:4000].contiguous()
    save_file(state, str(dst / "model.safetensors"))
    return dst


def _target():
    return ts.demo_pair()[0]


# (id, call(rt, bad_target), exception type, text the message must contain: the offending value)
API_CASES = [
    ("spec-float", lambda rt, b: ts.SpecConfig(2.5, 1, 3), ts.UserError, "num_speculative_tokens=2.5"),
    ("spec-bool", lambda rt, b: ts.SpecConfig(True, True, 2), ts.UserError, "num_speculative_tokens=True"),
    ("spec-zero", lambda rt, b: ts.SpecConfig(0, 8, 48), ts.UserError, "num_speculative_tokens=0"),
    ("spec-nodes", lambda rt, b: ts.SpecConfig(2, 2, 9), ts.UserError, "num_draft_tokens=9"),
    ("temperature", lambda rt, b: rt.generate(PROMPT, temperature=-1), ts.UserError, "temperature=-1"),
    ("temperature-str", lambda rt, b: rt.generate(PROMPT, temperature="hot"), ts.UserError, "temperature='hot'"),
    ("top-p", lambda rt, b: rt.generate(PROMPT, top_p=0), ts.UserError, "top_p=0"),
    ("top-k", lambda rt, b: rt.generate(PROMPT, top_k=-1), ts.UserError, "top_k=-1"),
    ("top-k-float", lambda rt, b: rt.generate(PROMPT, top_k=2.5), ts.UserError, "top_k=2.5"),
    ("max-new-0", lambda rt, b: rt.generate(PROMPT, max_new_tokens=0), ts.UserError, "max_new_tokens=0"),
    ("max-new-float", lambda rt, b: rt.generate(PROMPT, max_new_tokens=2.5), ts.UserError, "max_new_tokens=2.5"),
    ("bytes", lambda rt, b: rt.generate(b"abc"), ts.UserError, "b'abc'"),
    ("float-ids", lambda rt, b: rt.generate([1.0, 2.5]), ts.UserError, "[1.0, 2.5]"),
    ("bool-ids", lambda rt, b: rt.generate([True, 5]), ts.UserError, "[True]"),
    ("id-range", lambda rt, b: rt.generate([5, 99999]), ts.UserError, "[99999]"),
    ("empty", lambda rt, b: rt.generate([]), ts.UserError, "prompts is empty"),
    ("empty-prompt", lambda rt, b: rt.generate([[1], []]), ts.UserError, "prompt 1 is empty"),
    ("float-tensor", lambda rt, b: rt.generate(torch.ones(2, 3)), ts.UserError, "torch.float32"),
    ("3d-tensor", lambda rt, b: rt.generate(torch.ones(1, 2, 3, dtype=torch.int64)), ts.UserError, "got 3-D"),
    ("dict", lambda rt, b: rt.generate({"text": "x"}), ts.UserError, "prompts of type dict"),
    ("too-long", lambda rt, b: rt.generate([1] * 300), ts.UserError, "prompt 0 has 300 tokens"),
    ("seed-str", lambda rt, b: rt.generate(PROMPT, seed="abc"), ts.UserError, "seed='abc'"),
    ("seed-float", lambda rt, b: rt.generate(PROMPT, seed=1.5), ts.UserError, "seed=1.5"),
    ("seed-count", lambda rt, b: rt.generate(PROMPT, seed=[1, 2]), ts.UserError, "2 seeds for 1 prompts"),
    ("stop-id-range", lambda rt, b: rt.generate(PROMPT, stop_token_ids=[99999]), ts.UserError, "[99999]"),
    ("stop-id-neg", lambda rt, b: rt.generate(PROMPT, stop_token_ids=[-1]), ts.UserError, "[-1]"),
    ("stop-id-int", lambda rt, b: rt.generate(PROMPT, stop_token_ids=5), ts.UserError, "stop_token_ids=5"),
    ("stop-id-float", lambda rt, b: rt.generate(PROMPT, stop_token_ids=[2.5]), ts.UserError, "[2.5]"),
    ("stop-empty", lambda rt, b: rt.generate(PROMPT, stop=[""]), ts.UserError, "['']"),
    ("stream-batch", lambda rt, b: next(rt.stream([PROMPT, PROMPT])), ts.UserError, "stream() takes one prompt"),
    ("device-gpu", lambda rt, b: ts.TargetModel.from_pretrained(_target(), device="gpu"), ts.UserError, "'gpu'"),
    ("backend", lambda rt, b: ts.SpeculativeRuntime.from_pretrained(_target(), backend="tpu"), ts.UserError, "'tpu'"),
    ("dtype", lambda rt, b: ts.TargetModel.from_pretrained(_target(), dtype="half"), ts.UserError, "dtype='half'"),
    ("tokenizer-name", lambda rt, b: ts.SpeculativeRuntime(rt.target, tokenizer="gpt2"), ts.UserError, "'gpt2'"),
    ("tokenizer-int", lambda rt, b: ts.SpeculativeRuntime(rt.target, tokenizer=42), ts.UserError, "int"),
    ("max-seq-len", lambda rt, b: ts.SpeculativeRuntime(rt.target, max_seq_len=1), ts.UserError, "max_seq_len=1"),
    ("max-seq-len-big", lambda rt, b: ts.SpeculativeRuntime(rt.target, max_seq_len=10**6), ts.UserError, "1000000"),
    ("max-batch", lambda rt, b: ts.SpeculativeRuntime(rt.target, max_batch_size=0), ts.UserError, "max_batch_size=0"),
    ("drafter-type", lambda rt, b: ts.SpeculativeRuntime.from_pretrained(_target(), 42), ts.UserError, "int"),
    ("target-type", lambda rt, b: ts.TargetModel.from_pretrained(42), ts.UserError, "int"),
    ("target-dir", lambda rt, b: ts.TargetModel.from_pretrained("/nonexistent/t"), FileNotFoundError, "/nonexistent/t"),
    ("target-shapes", lambda rt, b: ts.TargetModel.from_pretrained(b), ts.UserError, "found (4000, 128)"),
]
if NO_CUDA:
    API_CASES.append(
        ("device-cuda", lambda rt, b: ts.TargetModel.from_pretrained(_target(), device="cuda"), ts.UserError, "'cuda'")
    )


@pytest.mark.parametrize("call, error, names", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input(rt, bad_target, call, error, names):
    with pytest.raises(error) as e:
        call(rt, bad_target)
    assert type(e.value) is error  # the family itself, not a bare ValueError / TypeError from deep inside
    assert names in str(e.value)


# (id, argv (BAD = the wrong-shaped target), text the one-line message must contain)
BAD = "<bad-target>"
GEN = ["generate", "--target", "demo", "--max-new-tokens", "2"]
CLI_CASES = [
    ("num-spec-0", GEN + ["--num-speculative-tokens", "0", "x"], "num_speculative_tokens=0"),
    ("draft-top-k-0", GEN + ["--draft-top-k", "0", "x"], "top_k=0"),
    ("draft-tokens-1", GEN + ["--num-draft-tokens", "1", "x"], "num_draft_tokens=1"),
    ("max-new-0", ["generate", "--target", "demo", "--max-new-tokens", "0", "x"], "max_new_tokens=0"),
    ("temperature", GEN + ["--temperature", "-1", "x"], "temperature=-1.0"),
    ("top-p", GEN + ["--top-p", "0", "x"], "top_p=0.0"),
    ("dtype", GEN + ["--dtype", "xx", "x"], "'xx'"),
    ("device", GEN + ["--device", "gpu", "x"], "'gpu'"),
    ("max-seq-len", GEN + ["--max-seq-len", "1", "x"], "max_seq_len=1"),
    ("empty-prompt", GEN + [""], "empty prompt"),
    ("target-dir", ["generate", "--target", "/nonexistent/t", "x"], "/nonexistent/t"),
    ("target-shapes", ["generate", "--target", BAD, "x"], "found (4000, 128)"),
    ("bench-prompts", ["bench", "--num-prompts", "0"], "--num-prompts 0"),
    ("bench-batch", ["bench", "--batch", "0"], "--batch 0"),
    ("bench-system", ["bench", "--systems", "nope"], "'nope'"),
]
if NO_CUDA:
    CLI_CASES.append(("device-cuda", GEN + ["--device", "cuda", "x"], "'cuda'"))
    CLI_CASES.append(("backend-triton", GEN + ["--backend", "triton", "x"], "backend='triton'"))


@pytest.mark.parametrize("argv, names", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(bad_target, argv, names, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a user's shell: Triton needs a GPU
    argv = [str(bad_target) if a == BAD else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tritonspec {argv[0]}: error: ") and err.count("\n") == 1, err
    assert names in err and "Traceback" not in err


def test_cli_process_exits_2_without_traceback():
    """The real entry point, in a process: exit status 2, one line, no traceback."""
    env = dict(os.environ, TRITONSPEC_TEST_THREADS="1")
    cmd = [sys.executable, "-m", "tritonspec", "generate", "--target", "demo", "--device", "gpu", "x"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines == ["tritonspec generate: error: device='gpu' is not a device name: use 'cpu', 'cuda' or 'cuda:N'"]


def test_export_into_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):  # a file, and a directory below a file
        assert main(["export", "--drafter", str(ts.demo_pair()[1]), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tritonspec export: error:") and err.count("\n") == 1, err
        assert str(blocker) in err
