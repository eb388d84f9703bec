"""Where a run computes and what it ran with: `auto` device and dtype, and the settings file of each command.

`--device auto` is cuda:LOCAL_RANK when CUDA is available (LOCAL_RANK is 0 outside torchrun), else cpu;
`--dtype auto` is bfloat16 on a GPU that supports it, float32 otherwise (bf16 is very slow on CPUs without
AVX512-BF16 or AMX; on one with them, `bf16_native` says so and the quickstart extracts and trains in bf16). A run
put on the CPU while a GPU is present says so once. Every resolved value is recorded in `RESOLVED`, so the
settings file a command writes beside its output (`write_settings`) holds what it ran with, not `auto`.
A settings file is a valid `--config FILE` for the same command (`read_settings`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: the values `auto` (and `""`) resolved to in this process: name -> value (written into the settings file)
RESOLVED: dict[str, str] = {}
#: where each setting of the running command came from: name -> "command line" or "config FILE"
GIVEN: dict[str, str] = {}
#: whether the running command was parsed from a command line (`cli.main`), where GIVEN is known
FROM_COMMAND_LINE = False
#: the command the command line runs (GIVEN is its settings', not those of a stage another command runs)
COMMAND = ""
#: the settings the running command filled in itself (train's small-run recipe): name -> what filled it
FILLED: dict[str, str] = {}
_warned: set[str] = set()

SETTINGS_VERSION = 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str, who: str = "specdraft") -> str:
    """`auto` (or empty) -> cuda:LOCAL_RANK when CUDA is available, else cpu; anything else as given. Warns
    (once per process) when a run is put on the CPU while a GPU is present."""
    if device in ("", "auto"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if _cuda_available() else "cpu"
        RESOLVED["device"] = device
    elif device == "cpu" and _cuda_available() and "cpu" not in _warned:
        _warned.add("cpu")
        print(f"{who}: warning: a GPU is present but this run is on the CPU (--device cpu); "
              "--device auto (the default) would use it", file=sys.stderr)  # fmt: skip
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` (or empty) -> bfloat16 on a CUDA device that supports it, float32 otherwise."""
    if dtype not in ("", "auto"):
        return dtype
    out = "float32"
    if str(device).startswith("cuda"):
        import torch

        out = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    RESOLVED["dtype"] = out
    return out


def bf16_native(device: str) -> bool:
    """Whether `device` computes bfloat16 matmuls natively: a CUDA GPU that supports bf16, or a CPU with AVX512-BF16
    or AMX tiles (oneDNN's bf16 kernels: 2.6x fp32 in a (2048, 576) x (576, 1536) matmul on this project's 2-core
    EPYC; without them torch emulates bf16, slower than fp32)."""
    import torch

    if str(device).startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if str(device) != "cpu":
        return False
    try:  # torch.cpu's capability probes (cpuinfo): private names, so a torch without them reads as "no"
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def _plain(v):
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


#: the positionals that name files and directories: a settings file records them absolute (read back from
#: anywhere, they point at the same place); hub ids and source names (`sharegpt`) are kept as given
PATH_SETTINGS = ("data", "dataset", "shards", "out", "checkpoint", "draft")


def _absolute(key: str, value):
    """`value` of a PATH_SETTINGS key with each existing path (and OUT, always) made absolute."""
    if isinstance(value, list):
        return [_absolute(key, v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if "," in value and key == "shards":
        return ",".join(_absolute(key, v) for v in value.split(","))
    return os.path.abspath(value) if key == "out" or os.path.exists(value) else value


def settings_doc(command: str, settings: dict, name: str = "FILE") -> dict:
    """The settings file's content: `settings` (flat: option name -> value; paths absolute), with what `auto`
    resolved to."""
    from specdraft import __version__

    return {
        "command": command,
        "specdraft_version": __version__,
        "settings_version": SETTINGS_VERSION,
        "settings": {k: _plain(_absolute(k, v) if k in PATH_SETTINGS else v) for k, v in settings.items()},
        "resolved": dict(RESOLVED),
        **({"from": origins(settings)} if FROM_COMMAND_LINE and command == COMMAND else {}),
        "note": f"a valid `specdraft {command} --config {name}`; options on the command line override it",
    }


def origins(settings: dict) -> dict[str, str]:
    """Where each of `settings` came from: the command line, a --config FILE (or the settings --resume read),
    what the command filled in itself (the small-run recipe), else the default."""
    return {k: GIVEN.get(k) or FILLED.get(k) or "default" for k in settings}


def write_settings(path: Path, command: str, settings: dict, keep: dict | None = None) -> Path:
    """Write the settings file of `settings` as `path` (atomically; `keep`: other keys to keep); returns it."""
    doc = {**(keep or {}), **settings_doc(command, settings, path.name)}
    path.parent.mkdir(parents=True, exist_ok=True)
    from specdraft.fileio import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")  # a temporary of this process's own, renamed
    return path


def read_settings(path: str | Path, command: str, label: str = "") -> dict:
    """The settings of a settings file (ours, or a flat JSON object of option name -> value) for `command`;
    errors name the file as `label` (default: `--config PATH`)."""
    p = Path(path)
    label = label or f"--config {p}"
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{label}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{label}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{label}: a JSON object of option -> value is needed")
    if "settings" in doc and isinstance(doc["settings"], dict):
        if doc.get("command") not in (None, command):
            raise ValueError(f"{label} holds the settings of `specdraft {doc['command']}`, not {command}")
        return dict(doc["settings"])
    return {k.replace("-", "_"): v for k, v in doc.items()}
