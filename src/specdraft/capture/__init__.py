"""capture: the extract stage, hidden states of the target at the EAGLE-3 layers.

Owns the capture backends behind one small interface (`hf.py`: transformers forward hooks; `vllm.py`:
hooks inside vLLM workers through the engine contract) and the resumable, sharded extraction
(`extract.py`). May import: `fileio`, `targets`, `engine`, `data`.
"""
