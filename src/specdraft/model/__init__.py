"""model: the EAGLE-3 draft.

Owns the draft network, its config and the reduced-vocabulary map d2t/t2d in one file (`draft.py`), and
a draft's files: save, load, newest checkpoint (`checkpoint.py`). May import: `fileio`, `targets`.
"""
