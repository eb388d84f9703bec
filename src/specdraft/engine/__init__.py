"""engine: THE ENGINE CONTRACT, what the backends use at run time.

`contract.py` declares every vLLM/transformers entry point specdraft calls (backends in `capture/`, `data/`
and `eval/` call engines only through it); `formats.py` the export formats and the config keys their readers
take; `usage.py` the conventions, option keys, metric names and environment variables the backends rely on;
`vllm_rpc.py` carries calls and blobs to vLLM workers; `vllm_kernels.py` self-tests (and repairs) the kernel
that carries the temperature into speculative verification; `options.py` parses and checks `--engine-args`;
`lifetime.py` ends every engine's processes when specdraft ends, `kill -9` included (a watchdog process).
The checker of all this against installed or other releases lives in `doctor/`, which reads this folder
and is never read by it. May import: `fileio`, `targets`.
"""
