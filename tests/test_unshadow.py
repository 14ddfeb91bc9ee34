"""The repository root is the package's folder: run from a checkout, ``python`` puts it first on
``sys.path``, where ``kernels/`` would shadow the ``kernels`` distribution transformers >= 5.25
imports. Importing tritonspec takes the folder off ``sys.path``, and ``kernels/__init__.py``
imported as a top-level module loads the distribution in its place (without one, it stays an empty
module whose attributes name the fix)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tritonspec

ROOT = Path(tritonspec.__file__).resolve().parent
OURS = str(ROOT / "kernels")  # our folder: a `kernels` found under it is ours, elsewhere the distribution
_DIST = importlib.util.find_spec("kernels")  # after import tritonspec: the distribution, if installed
needs_dist = pytest.mark.skipif(
    _DIST is None, reason="the `kernels` distribution is not installed (transformers < 5.25 does not need it)"
)
PROBE = "import sys; sys.path.insert(0, ''); {pre}import kernels; print(getattr(kernels, '__file__', None))"


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no `kernels` reached around -S
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)


def _kernels_origin(pre: str) -> str:
    r = _run(PROBE.format(pre=pre))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_checkout_is_first_on_the_path():
    # the inverse of the tests below: in their setting the path finder does find our folder first
    r = _run("import sys; sys.path.insert(0, ''); import importlib.util as u; print(u.find_spec('kernels').origin)")
    assert r.stdout.strip() == str(ROOT / "kernels" / "__init__.py"), r.stdout + r.stderr


@needs_dist
def test_importing_tritonspec_unshadows_the_kernels_distribution():
    origin = _kernels_origin("import tritonspec; print('imported'); ")
    assert origin.startswith("imported"), f"import tritonspec failed: {origin}"
    origin = origin.removeprefix("imported").strip()
    assert not origin.startswith(OURS), f"`import kernels` still finds the checkout's folder: {origin}"


@needs_dist
def test_without_tritonspec_a_top_level_import_gets_the_distribution():
    origin = _kernels_origin("")
    assert origin != "None" and not origin.startswith(OURS), origin


def test_transformers_imported_first_from_a_checkout():
    # the case _unshadow cannot reach: transformers' hub-kernels integration imports `kernels` first
    pytest.importorskip("transformers.integrations.hub_kernels")
    code = (
        "import sys; sys.path.insert(0, ''); import transformers.integrations.hub_kernels; "
        "print(getattr(sys.modules.get('kernels'), '__file__', None)); "
        "import tritonspec as ts; t, d = ts.demo_pair('eagle3.1'); "
        "rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=1, max_seq_len=64); "
        "print(len(rt.generate('def f(x):', max_new_tokens=4).token_ids[0]))"
    )
    r = _run(code)
    assert r.returncode == 0 and r.stdout.split()[-1] == "4", r.stderr[-2000:]
    origin = r.stdout.split()[0]
    if _DIST is not None:  # transformers got the distribution, not the checkout's folder
        assert origin != "None" and not origin.startswith(OURS), origin


def test_without_the_distribution_an_empty_module_that_names_the_fix():
    # -S: no site-packages, so no `kernels` distribution; transformers' availability check reads
    # __version__ with a default, so the import itself must succeed
    code = PROBE.format(pre="") + "; print(getattr(kernels, '__version__', 'N/A')); kernels.get_kernel"
    r = _run(code, "-S")
    assert r.stdout.split()[-1] == "N/A", r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("AttributeError: module 'kernels' has no attribute 'get_kernel'"), last
    assert "pip install kernels" in last and "tritonspec.kernels" in last, last


def test_a_top_level_module_imported_from_the_checkout_is_forgotten():
    code = (
        "import sys; sys.path.insert(0, ''); import runtime.errors; import tritonspec; "
        "print('runtime' in sys.modules, 'runtime.errors' in sys.modules, '' in sys.path)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["False", "False", "False"]


@needs_dist
def test_an_import_hook_wrapping_the_path_finder_does_not_loop():
    # a meta-path hook that finds `kernels` on the whole sys.path returns our folder again: skipped
    code = (
        "import sys, importlib.machinery as m\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        return m.PathFinder.find_spec(name, path) if name == 'kernels' else None\n"
        "sys.meta_path.insert(0, Hook()); sys.path.insert(0, '')\n"
        "import kernels; print(kernels.__file__)"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not r.stdout.strip().startswith(OURS), r.stdout


def test_a_distribution_installed_inside_the_checkout_is_found():
    # a virtual environment inside the checkout: its `kernels` is the distribution, not our folder
    import shutil
    import tempfile

    venv = Path(tempfile.mkdtemp(prefix=".test-venv-", dir=ROOT))
    try:
        (venv / "kernels").mkdir()
        (venv / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
        code = f"import sys; sys.path.insert(0, ''); sys.path.append({str(venv)!r}); import kernels; "
        code += "print(kernels.MARK)"
        r = _run(code, "-S")  # -S: only the fake distribution is on the path
        assert r.returncode == 0 and r.stdout.strip() == "installed", r.stdout + r.stderr
    finally:
        shutil.rmtree(venv)
