"""Test-session setup: without CUDA, Triton kernels run under the interpreter.

``TRITON_INTERPRET`` must be set before triton is first imported, hence here, at conftest
import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny test models are faster on one thread, and several intra-op threads on a busy 2-core
# machine spin against each other (a 100x slowdown was measured): one thread unless overridden.
torch.set_num_threads(int(os.environ.get("TRITONSPEC_TEST_THREADS", "1")))

import pytest  # noqa: E402

# takes the checkout off sys.path (``python -m pytest`` puts it first, where our ``kernels/`` would shadow
# the ``kernels`` distribution transformers >= 5.25 imports): see tritonspec._unshadow
import tritonspec  # noqa: E402, F401


@pytest.fixture(autouse=True)
def tuned_dir(tmp_path, monkeypatch):
    """Every test sees an empty tuned-config folder: a profile in the user's cache must never
    change which tree shape or kernel config a test runs."""
    from tritonspec.kernels import store

    d = tmp_path / "tuned"
    monkeypatch.setenv(store.ENV_DIR, str(d))
    store.clear_cache()
    yield d
    store.clear_cache()
