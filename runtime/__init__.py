"""The runtime: models, decode state and the decode loop. Imports only ``kernels`` (and ``demo``).

Models and their files
    ``target.py``        our compact forward of a Llama-family target (static KV cache, aux capture)
    ``drafter.py``       the EAGLE-3 / EAGLE-3.1 drafter module (``drafter_config.py``: its config)
    ``checkpoint.py``    drafter checkpoint formats, read and written (beside ``weights.py``:
                         safetensors/bin loading, ``load_tokenizer``)
    ``serving.py``       what vLLM and SGLang loaders read (rules, with sources) and the export report
    ``rope.py``          rotary tables; ``tiny.py``: tiny random models for tests and demos
One round
    ``metadata.py``      ``AttentionMetadata`` (positions, slots, prefix, mask) and ``KVCache``
    ``ops.py``           the ``Ops`` protocol a backend provides; ``TorchOps`` (the references)
    ``tree.py``          EAGLE-2 tree expansion helpers (rerank, build the tree mask)
    ``sampling.py``      sampling parameters, logits processing, counter-based per-row RNG
    ``deterministic.py`` deterministic mode: ``DeterministicOps`` (row-invariant ops, probed per shape),
                         the position-keyed sampling race
    ``decode.py``        ``Decoder``: the decode state and prefill / draft / verify / commit / round
The façade and around it
    ``engine.py``        ``SpeculativeRuntime``: construction, ``generate`` / ``stream``, graph dispatch
    ``requests.py``      host-side request handling: encoding, seeds, stop ids and strings, outputs
    ``graphs.py``        CUDA-graph capture and replay (and a CPU replay emulator for tests)
    ``profiles.py``      tuned tree-shape profiles: the schema, read by ``SpeculativeRuntime(spec=None)``
    ``config.py``        ``SpecConfig``, ``SpecStats``, ``GenerationOutput``, ``StreamPiece``
    ``drift.py``         attention-drift diagnostics (an observer of the drafter's forwards)
    ``bench.py``         side-by-side systems and round profiles for ``tritonspec bench`` and ``perf/``
    ``audit.py``         ``tritonspec audit``: deterministic mode certified on a prompt set (MD + JSON report)
"""
