"""Stand-in package (see tests/engine_pair/sglang_dflash/README.md)."""
