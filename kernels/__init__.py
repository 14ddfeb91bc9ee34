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
* ``triton_ops``: ``TritonOps``, the Triton backend of ``runtime.ops``
* ``cpu_linear``: the torch backend's CPU linear layer, a C kernel (``cpu/linear.c``, AVX-512 and
  AVX512-BF16, or AVX2 + FMA through ``cpu/avx2.h``, built with the system compiler on first use):
  weights streamed at memory speed, every row bit-identical whatever the row count (Triton has no CPU target here)

Beside them: ``utils`` (the guarded Triton import, argument checks, and the helpers more than one
kernel uses) and ``store`` (the per-device tuned-config files: the launchers read them, ``tritonspec
autotune kernels`` writes them; shipped files live in ``configs/``). Nothing here imports the
runtime, the tuner or the root package.
"""
