"""Recipes: each is one command that rebuilds a shipped artefact from data on this machine.

* ``recipes.demo``  the bundled demo pair (``tritonspec/demo/``): corpus, tokenizer, target, prompt
  sets and the EAGLE-3 / EAGLE-3.1 drafters — ``python -m tritonspec.recipes.demo --out <package>/demo``.

Recipes sit above ``training`` (they call the trainer); nothing in the library below them imports them.
"""
