"""doctor/scan: `doctor --scan`, another package's calls into vLLM bound against a release.

`source.py` finds the package (dir, wheel, name==version); `walk.py` and `expr.py` read it;
`values.py` and `struct.py` type its values; `check.py` binds the calls; `report.py` runs and reports.
May import: `doctor.check`, `doctor.source`, `doctor.release`.
"""
