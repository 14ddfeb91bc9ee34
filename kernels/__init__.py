"""Hot-path operators. One module per op: Triton kernel(s), a thin launcher and a plain
PyTorch ``<op>_reference`` that the torch backend, the tests and the benchmarks share."""
