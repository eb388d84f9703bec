"""model: the EAGLE-3 draft.

Owns the draft network, its config and the reduced-vocabulary map d2t/t2d in one file (`draft.py`); the
target's tensors a draft shares (embeddings, final norm, lm_head), read without the decoder layers
(`frozen.py`); a draft's files: save (optionally without the frozen embeddings, re-read from the target
on load), load, newest checkpoint (`checkpoint.py`). The block-parallel DFlash draft (`dflash.py`) and its
files, its own and the vLLM/SGLang served formats (`dflash_files.py`). May import: `fileio`, `targets`.
"""
