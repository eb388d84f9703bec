"""engine: the engine contract and `specdraft doctor`.

Owns every external engine entry point specdraft relies on (`contract.py`, declared once), the helpers
that carry calls and blobs to vLLM workers through that contract (`vllm_rpc.py`), the static signature
reader for another version's source (`static_sig.py`), the binding checks (`check.py`) and the doctor
command (`doctor.py`). May import: `fileio`, `targets`. Backends in `capture/` and `eval/` call engines
only through `contract`.
"""
