"""Resumable training checkpoints: write OUT/checkpoints/step_N, prune old ones, load one back on --resume.

A checkpoint is a saved draft (`specdraft.model.checkpoint.save_draft`: config.json + model.safetensors)
plus `train_state.pt` (STATE_FILE: step, optimizer, scheduler, RNG states, the settings, the number of
ranks, the batch plan's hash, the data provenance); `OUT/checkpoints/latest` (LATEST_FILE) names the
newest complete one. Finding it is `specdraft.model.checkpoint.latest_checkpoint`. `--resume` refuses a
checkpoint trained on other data (the provenance's extraction and dataset hashes). A full disk met while
writing a checkpoint or final/ is reported naming that path (`disk_errors_named`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdraft.fileio import (
    LOCK_FILE,
    TMP_PATTERN,
    atomic_write_text,
    changed_settings,
    remove_dead_leftovers,
    remove_dir,
    tmp_path,
)
from specdraft.model.checkpoint import (
    CONFIG_FILE,
    LATEST_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    load_draft_state,
    save_draft,
)
from specdraft.model.draft import Eagle3Draft
from specdraft.train.config import _RESUME_FREE, SETTINGS_FILE, SMALL_RUN, TrainConfig
from specdraft.train.distributed import _all_min


class NonFiniteError(ValueError):
    """Training met a non-finite loss, gradient or weights; the message names the step, what to change and the
    last good checkpoint."""


#: what a training run writes at the top of OUT (its files, the trackers' folders, the directory lock)
TRAIN_WRITES = frozenset({"checkpoints", "final", "metrics.jsonl", SETTINGS_FILE, "training.png", "tb", "wandb",
                          "trackio", "mlruns", LOCK_FILE})  # fmt: skip
#: what a run writes into final/ (EAGLE-3's or DFlash's draft files and the settings record), replaced whole
FINAL_WRITES = frozenset({CONFIG_FILE, WEIGHTS_FILE, SETTINGS_FILE, "mask_embedding.pt"})


def holds_run(out: Path) -> bool:
    """Whether OUT holds a training run's files: its settings record, a checkpoint, or a trained final/."""
    from specdraft.model.checkpoint import latest_checkpoint
    from specdraft.model.dflash_files import newest_checkpoint

    return any((out / f).is_file() for f in (SETTINGS_FILE, f"final/{CONFIG_FILE}")) or bool(
        latest_checkpoint(out) or newest_checkpoint(out)
    )


def foreign_files(out: Path, held: bool) -> list[str]:
    """The files under OUT that training did not write and a run would replace or delete, relative to OUT: in an
    OUT holding a run (`held`), those in final/ (replaced whole); in any other, every file but the directory
    lock and dead writers' temporaries (a run writes only into a new or empty OUT, or an earlier run's)."""
    if not out.is_dir():
        return []
    final = out / "final"
    if held:
        return (
            [f"final/{p.name}" for p in sorted(final.iterdir()) if p.name not in FINAL_WRITES]
            if final.is_dir()
            else []
        )
    found = []
    for p in sorted(out.iterdir()):
        if p.name == LOCK_FILE or TMP_PATTERN.match(p.name):
            continue
        inner = sorted(q for q in p.rglob("*") if not q.is_dir()) if p.is_dir() else []
        found += [str(q.relative_to(out)) for q in inner] or [p.name + ("/" if p.is_dir() else "")]
    return found


def foreign_problem(out: Path) -> list[str]:
    """The refusal of an OUT holding files training did not write (`foreign_files`), as export and eval refuse."""
    held = holds_run(out) if out.is_dir() else False
    theirs = foreign_files(out, held)
    if not theirs:
        return []
    shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
    what = f"replace {out / 'final'} (a run writes it whole)" if held else f"write into {out}"
    return [f"refusing to {what}: it holds files train did not write ({shown}): move them out, or choose a new "
            "or empty OUT directory (or an earlier run's)"]  # fmt: skip


def in_the_way(out: Path) -> list[str]:
    """The directories under OUT/checkpoints named exactly like a checkpoint (`CHECKPOINT_DIR`) that training did
    not write and would replace: no train_state.pt, and files other than a partial save's."""
    root = out / "checkpoints"
    found = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not CHECKPOINT_DIR.fullmatch(p.name) or (p / STATE_FILE).is_file():
            continue
        theirs = (
            sorted(q.name for q in p.iterdir() if q.name not in (CONFIG_FILE, WEIGHTS_FILE))
            if p.is_dir()
            else ["a file"]
        )
        if theirs:
            found.append(f"{p} is in the way of the checkpoint of its step and holds files specdraft did not write "
                         f"({', '.join(theirs)}): move it out of {root}")  # fmt: skip
    return found


def check_weights(params: list[torch.Tensor], step: int, lr: float, last_good: str, device) -> None:
    """Raise NonFiniteError when the update of optimizer step `step` (at learning rate `lr`) left a weight that
    is not finite on any rank (all ranks agree): checked after every update, so no checkpoint holds one."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2: this rank's shard
    ok = torch.stack([torch.isfinite(t.detach()).all() for t in local]).all() if local else torch.tensor(True)
    if _all_min(ok.float().to(device)).item() < 1:
        raise NonFiniteError(f"the weights stopped being finite at the update of step {step} (learning rate "
                             f"{lr:g}); that step was not saved, last good checkpoint: {last_good}. Lower --lr")  # fmt: skip


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_states(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state dicts; a collective under FSDP (all ranks call)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=fsdp)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def _draft_from_state(draft: Eagle3Draft, full_model_state: dict) -> Eagle3Draft:
    """A CPU copy of the draft holding a full model state (keys `draft.*` of the TTT model)."""
    cpu = Eagle3Draft(draft.cfg)
    cpu.load_state_dict({k.removeprefix("draft."): v for k, v in full_model_state.items()}, strict=True)
    return cpu


def _save_checkpoint(
    out: Path,
    step: int,
    draft_cpu: Eagle3Draft,
    opt_state: dict,
    sched,
    info: dict,
    keep: int,
    embed_from=None,
) -> Path:
    """Write OUT/checkpoints/step_N (draft files + train_state.pt) atomically, point `latest` at it, prune old ones."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(root)  # a killed writer's temporaries (ours by name and a dead pid), nothing else
    name = f"step_{step:08d}"
    tmp = tmp_path(root / name)
    shutil.rmtree(tmp, ignore_errors=True)
    state = {
        "step": step,
        "optimizer": opt_state,
        "scheduler": sched.state_dict(),
        "rng": _rng_state(),
        **info,
    }
    try:
        with disk_errors_named(root / name):
            save_draft(draft_cpu, tmp, embed_from=embed_from)  # the frozen embedding by reference when known
            torch.save(state, tmp / STATE_FILE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not stay full of a partial checkpoint
        raise
    final = root / name
    theirs = in_the_way(out) if final.exists() and not (final / STATE_FILE).is_file() else []
    if theirs:  # a user's directory under this exact name (made while the run went on): kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"train: {theirs[0]}, then resume")
    if final.exists():  # this step's own checkpoint written again: renamed away, then deleted
        remove_dir(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST_FILE, name)
    for old in written_checkpoints(root)[:-keep]:
        remove_dir(old)
    return final


#: the exact name of a checkpoint directory this module writes (a user's step_00000011_mybackup is not one)
CHECKPOINT_DIR = re.compile(r"step_[0-9]{8}")


def written_checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories under `root` that training wrote (that exact name, holding its
    train_state.pt), oldest first: the only ones pruning removes."""
    found = [p for p in root.iterdir() if CHECKPOINT_DIR.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


@contextlib.contextmanager
def disk_errors_named(path: Path):
    """Re-raise a full disk met while writing `path` as OSError(ENOSPC) naming `path`, however the writer
    reports it (safetensors and torch raise their own errors, without the path)."""
    try:
        yield
    except Exception as e:
        full = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or any(
            m in str(e) for m in ("No space left on device", "os error 28")
        )
        if not full or (isinstance(e, OSError) and e.filename):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e


def _check_same_data(ckpt: Path, old: dict, now: dict) -> None:
    """Refuse to resume on data other than the checkpoint's (its extraction or dataset content hash)."""
    for key in ("extraction", "dataset_hash"):
        if key in old and old[key] != now.get(key):
            raise ValueError(f"train --resume: {ckpt} was trained on other data ({key} {old[key]} there, "
                             f"{now.get(key)} now): resume with the data it started on, or start in a new OUT directory")  # fmt: skip


def _load_train_state(
    ckpt: Path, cfg: TrainConfig, world: int, plan_hash: str, provenance: dict | None = None
) -> dict:
    """The checkpoint's train_state.pt; refused when the math settings, the ranks or the data differ."""
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    _check_same_data(ckpt, state.get("provenance", {}), provenance or {})
    old = state["config"]
    defaults = asdict(TrainConfig())  # a setting newer than the checkpoint: its default is what it ran with
    changed = [k for k, _, _ in changed_settings(old, asdict(cfg), defaults, skip=_RESUME_FREE)]
    if state["world"] != world:
        again = (
            f"torchrun --nproc_per_node {state['world']} -m specdraft.cli"
            if state["world"] > 1
            else "specdraft"
        )
        changed.append(f"{state['world']} ranks instead of {world}: resume as it ran, `{again} train ... --resume`")  # fmt: skip
    hint = ""
    if changed and set(changed) <= {*SMALL_RUN, "recipe"}:  # what --recipe auto decides from the data alone
        hint = (" (these are the small-run recipe's: resume with the --recipe the run started with; a run from "
                "before --recipe existed: --recipe off)")  # fmt: skip
    if changed or state["plan_hash"] != plan_hash:
        raise ValueError(f"train --resume: {ckpt} was written with other settings ({', '.join(changed) or 'data'})"
                         f"{hint}: resume with the same settings and data, or start in a new OUT directory")  # fmt: skip
    return state


def _restore(ckpt: Path, state: dict, model: nn.Module, optimizer, scheduler) -> int:
    """Load the checkpoint's weights, optimizer, schedule and RNG states into this run; returns its step."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    weights = {
        f"draft.{k}": v for k, v in load_draft_state(ckpt).items()
    }  # embedding re-read from the target
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["step"]
