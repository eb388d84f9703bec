"""doctor/formats: our export formats against the engines' readers of them.

`check.py` checks each declared format (keys read, weight names, aux-id convention) against the installed
or `--against` source; `reads.py` lists the config keys a reader takes (`ast`, following the config into the
engine's helpers it calls); `model.py` the weight names and layer-id checks of the draft model class;
`against.py` runs them against another engine (SGLang).
May import: `engine`, `doctor.check`, `doctor.source`, `doctor.release`.
"""
