"""eval: the eval stage, acceptance length, lossless check and speed of a draft against its target.

Read in this order:
  `prompts.py`      what is decoded: prompts (MT-bench, files, lists), rendering a turn, stop ids;
  `stats.py`        the figures, defined once for both engines: tau, acceptance per position, divergences;
  `reference.py`    the evaluation with specdraft's own decoder (`specdraft.decode`): `evaluate_report`;
  `serving.py`      the evaluation served by vLLM: `evaluate_vllm`, on `vllm_engine.py` (the engine and
                    its spec-decode counters) and `batch1.py` (batch 1, interleaved with the target alone);
  `parity.py`       does vLLM run our draft: `drafter_parity` (on what `vllm_worker.py`, imported inside
                    vLLM's worker, records) and `compare_with_reference`;
  `report.py`       summary lines for either report, the plots;
  `command.py`      `specdraft eval` itself (`--engine hf|vllm`).
May import every lower layer: `fileio`, `targets`, `engine`, `data`, `model`, `capture`, `decode`,
`export`.
"""
