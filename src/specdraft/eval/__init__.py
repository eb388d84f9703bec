"""eval: the eval stage, acceptance length, lossless check and speed of a draft against its target.

Owns prompts, the reference evaluation and its report and plots (`reference.py`), and the evaluation
served by vLLM (`vllm.py`). May import every lower layer: `fileio`, `targets`, `engine`, `data`,
`model`, `capture`, `decode`, `export`.
"""
