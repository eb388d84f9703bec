"""doctor/release: another engine release (`--against`): which package and wheel, download and unpack,
cached per package, and its pins against this environment (`wheel.py`).

May import: `doctor.check` (for `Problem`).
"""
