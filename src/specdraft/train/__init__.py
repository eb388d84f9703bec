"""train: the train stage, the EAGLE-3 draft trained with training-time test (TTT).

Owns the training loop (`loop.py`: a visible function over named steps). May import: `fileio`,
`targets`, `data`, `model`, `capture` (online mode pulls hidden states from a target in process).
"""
