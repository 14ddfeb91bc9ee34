"""Kernel-config search and the tree-shape tuner.

* ``kernel_tuner``: candidate configs per kernel timed through the real launchers, written to the
  per-device config store (``kernels/store.py``)
* ``tree_tuner``: the draft-tree shape tuned per target + drafter + device (``tune_tree``), from
  ``tree_model`` (the predicted speed of a shape, pure arithmetic) and ``tree_measure`` (its inputs,
  measured through the runtime's decoder); the profile file is ``runtime/profiles.py``'s

The command line is ``tritonspec autotune kernels|tree`` (``cli/autotune.py``). Kept import-light:
nothing is imported here.
"""
