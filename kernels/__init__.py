"""Hot-path operators, one module per op: the Triton kernel(s), a launcher that checks its
arguments and allocates outputs, and a plain PyTorch ``<op>_reference`` that the torch backend,
the tests and the benchmarks share.

* ``rms_norm``: RMSNorm, with an optional fused residual add
* ``aux_gather``: gather of the accepted tokens' aux states, with EAGLE-3.1's per-state RMSNorm fused
* ``kv_write``: scatter of new K/V into one layer's cache
* ``tree_attention``: attention over a cached prefix plus the draft tree (``tree_visibility``: its mask)
* ``prefill_attention``: causal attention of a prompt (PyTorch SDPA, shared by both backends)
* ``verify``: greedy tree verification (``verify_greedy``)
* ``verify_sampling``: lossless stochastic tree verification
* ``verify_chain``: lossless verification of a sampled draft chain
* ``kv_compact``: KV-cache compaction along the accepted path
* ``batch_invariant_matmul``: a matmul with one fixed tile configuration (no split-K), row-invariant
  bit for bit: deterministic mode's linear layers on a GPU
* ``det_attention``: tree and causal attention over each query's canonical sequence (prefix, then its
  visible tree slots, in fixed blocks and splits): deterministic mode's attention on a GPU
* ``triton_ops``: ``TritonOps``, the Triton backend of ``runtime.ops``
* ``cpu_linear``: the torch backend's CPU linear layer, a C kernel (``cpu/linear.c``, AVX-512 and
  AVX512-BF16, or AVX2 + FMA through ``cpu/avx2.h``, built with the system compiler on first use):
  weights streamed at memory speed, every row bit-identical whatever the row count (Triton has no CPU target here)
* ``cpu_prefill``: the torch backend's causal prefill attention on AVX-512 CPUs, a C kernel
  (``cpu/prefill.c``, the same build) that skips the masked half (prompts only; not row-invariant)

Beside them: ``utils`` (the guarded Triton import, argument checks, and the helpers more than one
kernel uses) and ``store`` (the per-device tuned-config files: the launchers read them, ``tritonspec
autotune kernels`` writes them; shipped files live in ``configs/``). Nothing here imports the
runtime, the tuner or the root package.
"""

if __name__ == "kernels":  # pragma: no cover - exercised in subprocesses (tests/test_unshadow.py)
    # Imported as a top-level module: a checkout's root (this package's parent folder, the
    # repository root) is on ``sys.path``, as it is for ``python`` run inside the checkout. Our
    # modules are ``tritonspec.kernels.*`` only; the top-level name belongs to the ``kernels``
    # distribution (Hugging Face's hub kernels, imported by transformers >= 5.25). Load that one in
    # our place (``import kernels`` returns what ``sys.modules`` holds once this body ran). Without
    # it, stay an empty module, as transformers' availability check expects of a package it cannot
    # use (it reads ``__version__`` with a default), and name the fix on any other attribute.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    def _find_distribution():
        here = _os.path.dirname(_os.path.realpath(__file__))
        root = _os.path.dirname(here)

        def usable(spec):  # a loadable spec that is not this folder again (an import hook may wrap PathFinder);
            # one elsewhere under the checkout (a virtual environment in it) is the distribution
            origin = _os.path.realpath(getattr(spec, "origin", None) or "")
            return spec is not None and spec.loader is not None and not origin.startswith(here + _os.sep)

        for finder in _sys.meta_path:  # editable installs' finders first, then the path without the checkout
            if finder is _machinery.PathFinder or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec("kernels", None)
            if usable(spec):
                return spec
        path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != root]
        spec = _machinery.PathFinder.find_spec("kernels", path)
        return spec if usable(spec) else None

    _spec = _find_distribution()
    if _spec is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # (another thread importing it meanwhile may see it half-run)
        _spec.loader.exec_module(_module)
    else:

        def __getattr__(name: str):
            raise AttributeError(
                f"module 'kernels' has no attribute {name!r}: this is the folder {__path__[0]} (tritonspec.kernels, "
                "found as a top-level module because a tritonspec checkout is on sys.path), not Hugging Face's "
                "`kernels` distribution: pip install kernels, or import tritonspec.kernels"
            )
