"""Kernel-config search, the per-device config store and the tree-shape tuner."""
