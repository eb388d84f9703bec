"""A draft's files: save and load a draft directory, find the newest training checkpoint.

A draft directory holds `config.json` (format `specdraft.eagle3`, the DraftConfig) and
`model.safetensors`; `specdraft train` writes them under OUT/final and OUT/checkpoints/step_N (with
`train_state.pt` beside, and `OUT/checkpoints/latest` naming the newest). Export and eval read drafts
through :func:`load_trained`, so no later stage reaches into the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from specdraft.fileio import tmp_path
from specdraft.model.draft import CONFIG_FILE, FORMAT, WEIGHTS_FILE, DraftConfig, Eagle3Draft

STATE_FILE = "train_state.pt"  # optimizer, schedule, RNG and data position of a training checkpoint
LATEST_FILE = "latest"  # OUT/checkpoints/latest: the name of the newest complete checkpoint


def save_draft(draft: Eagle3Draft, path: str | Path, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (fp32 state incl. d2t, t2d, embed_tokens) atomically to `path`."""
    from safetensors.torch import save_file

    from specdraft import __version__

    path = Path(path)
    tmp = tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "specdraft_version": __version__, "config": asdict(draft.cfg), **(extra or {})}
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    for f in (WEIGHTS_FILE, CONFIG_FILE):
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    if path.exists():  # replace an older save: move it aside first so a crash never leaves neither
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


def load_draft_config(path: str | Path) -> DraftConfig:
    """The DraftConfig of a saved draft directory."""
    p = Path(path) / CONFIG_FILE
    if not p.exists():
        raise FileNotFoundError(f"{p.parent} is not a saved draft (no {CONFIG_FILE}): point at a `final/` or "
                                "`checkpoints/step_*/` directory written by `specdraft train`")  # fmt: skip
    meta = json.loads(p.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p} has format {meta.get('format')!r}, not {FORMAT!r}: is this an exported checkpoint? "
                         "load the training output instead")  # fmt: skip
    return DraftConfig(**meta["config"])


def load_draft(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Eagle3Draft:
    """Load a draft written by `save_draft` (strict: every tensor must match)."""
    from safetensors.torch import load_file

    cfg = load_draft_config(path)
    draft = Eagle3Draft(cfg)
    draft.load_state_dict(load_file(str(Path(path) / WEIGHTS_FILE)), strict=True)
    draft.embed_tokens.weight.requires_grad_(False)
    return draft.to(device=device, dtype=dtype)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint directory under OUT/checkpoints, or None."""
    root = Path(out) / "checkpoints"
    pointer = root / LATEST_FILE
    if pointer.exists():
        p = root / pointer.read_text().strip()
        if (p / STATE_FILE).exists():
            return p
    found = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).exists())
    return found[-1] if found else None


def load_trained(path: str | Path) -> Eagle3Draft:
    """A draft from a saved draft dir (`final/`, `checkpoints/step_*/`) or a `specdraft train` output dir.

    A train output dir gives its `final/` draft when training finished, else its newest checkpoint.
    """
    p = Path(path)
    if (p / CONFIG_FILE).exists():
        return load_draft(p)
    if (p / "final" / CONFIG_FILE).exists():
        return load_draft(p / "final")
    ck = latest_checkpoint(p) if (p / "checkpoints").is_dir() else None
    if ck is None:
        raise FileNotFoundError(f"{p} is neither a saved draft dir (with {CONFIG_FILE}) nor a `specdraft train` "
                                "output dir (with final/ or checkpoints/)")  # fmt: skip
    return load_draft(ck)
