"""doctor: `specdraft doctor`, the checker of the engine contract; it reads `engine/` and is never read by it.

`command.py` is the command and its report (environment, target, the installed engine bound once and
cached); `check.py` binds the contract's entries (`Problem`, the finding every check returns);
`usage_check.py` checks the declared conventions. Sub-folders, one concern each: `source/` reads an
engine's source without importing it, `release/` finds, downloads and pins another release, `formats/`
checks the export formats against the engines' readers, `scan/` binds another package's engine calls.
May import: `fileio`, `targets`, `engine`. Sub-folders import `check` and `source`, never `command`.
"""
