"""data: the prepare stage and the files stages hand each other.

Owns conversations -> token ids + assistant loss mask (`prepare.py`), the sharded hidden-state store
with its manifests and `verify` (`store.py`), and batching by token budget (`batching.py`).
May import: `fileio`, `targets`.
"""
