"""Drafter training (EAGLE-3 / EAGLE-3.1 training-time test) and the demo-pair recipe."""
