"""engine: the engine contract and `specdraft doctor`.

Owns every external engine entry point specdraft relies on (`contract.py`, declared once, with the export
formats in `formats.py` and the conventions, option keys, metric names and environment variables in
`usage.py`), the helpers that carry calls and blobs to vLLM workers through that contract (`vllm_rpc.py`), the
parsing and checking of a user's `--engine-args` (`options.py`),
the static signature reader for another version's source (`static_sig.py`), another release's wheel, pins
and cache (`release.py`), the binding checks (`check.py`; the export formats against vLLM's and SGLang's
readers in `format_check.py`, `format_model.py`, `config_reads.py`, `format_against.py`; `usage_check.py`),
the scanner of other packages' engine calls (`scan*.py`: `scan_source` finds the package, `scan_walk` and
`scan_walk_expr` read it, `scan_values`/`scan_struct` type its values, `scan_check` binds them, `scan`
reports) and the doctor command (`doctor.py`). May import: `fileio`, `targets`. Backends in `capture/`,
`data/` and `eval/` call engines only through `contract`.
"""
