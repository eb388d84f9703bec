"""doctor/refusals: the refusals a release adds on values we pass or write, read statically (`--against`).

`scopes.py` lists the engine code that sees our values (each declared entry point with its ``__init__``,
``__post_init__`` and validators, the config class of each dict option we pass, each reader of our export
formats) and what we pass there; `collect.py` lists the ``raise``/``assert`` there with their condition,
message and the fields they read; `judge.py` evaluates a condition on our value; `check.py` diffs a release
against the installed one and reports.
May import: `engine`, `doctor.check`, `doctor.source`, `doctor.formats`.
"""
