"""doctor/release: another engine release (`--against`): which package and wheel, download and unpack,
cached per package, and its pins against this environment (`wheel.py`); `--live` tries the release for real
in an isolated environment of its own, built once and cached (`live.py`), where `probe.py` -- a standalone
script that imports nothing of specdraft -- imports, binds and runs the release's config code.

May import: `fileio`, `engine` (the contract), `targets` (a target's local directory), `doctor.check` (for
`Problem`).
"""
