"""decode: speculative decoding with a transformers target, the reference decoder.

Owns the acceptance rules (greedy and rejection sampling), chain and dynamic-tree drafting, and the
target/drafter runners with KV caches (`speculate.py`). May import: `fileio`, `targets`, `model`.
"""
