"""doctor/source: an engine's source read statically (`reader.py`: modules, classes, signatures, attributes).

No import of the engine, no install: another version's wheel is read as text with `ast`.
May import: nothing of specdraft.
"""
