"""Kernel-config search, the per-device config store and the tree-shape tuner.

* ``store``: vLLM-style per-device JSON configs, nearest-bucket lookup (the kernel launchers read it)
* ``kernel_tuner``: candidate configs per kernel timed through the real launchers
* ``profile`` / ``tree_tuner``: the draft-tree shape tuned per target + drafter + device
* ``cli``: ``tritonspec autotune kernels|tree``

Kept import-light: the kernel modules import ``store`` at import time.
"""
