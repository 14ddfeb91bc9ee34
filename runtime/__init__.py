"""Target adapter, drafter, draft tree, verification, KV cache and the decode engine."""
