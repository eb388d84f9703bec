"""decode: speculative decoding with a transformers target, the reference decoder.

Read in this order: `speculate.py` (the settings, one decoding round -- catch up, draft, verify, accept --
and the `Speculator` facade), `rules.py` (the acceptance rules, greedy and rejection sampling, each stated
at its code), `tree.py` (the dynamic EAGLE-2 draft tree and its attention mask), `runners.py` (the
target and draft behind small interfaces, with their KV caches), `block.py` (block-parallel DFlash drafts:
one draft forward per round, verified by the same rule). May import: `fileio`, `targets`, `model`.
"""
