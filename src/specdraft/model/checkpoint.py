"""A draft's files: save and load a draft directory, find the newest training checkpoint.

A draft directory holds `config.json` (format `specdraft.eagle3`, the DraftConfig) and
`model.safetensors`; `specdraft train` writes them under OUT/final and OUT/checkpoints/step_N (with
`train_state.pt` beside, and `OUT/checkpoints/latest` naming the newest). Export and eval read drafts
through :func:`load_trained`, so no later stage reaches into the trainer.

The frozen embeddings (V x H, a copy of the target's: 4.7 GB in fp32 for a Kimi-K2.5-class target) can be
left out of a save (`save_draft(..., embed_from=frozen.embed_source)`, for training checkpoints):
config.json then records where they come from (`embed_tokens`: the target's directory, its
`weights_fingerprint`, the tensor name) and :func:`load_draft` reads them back from the target alone
(`model.frozen.load_embeddings`), refusing when the target's weights changed since. `final/` drafts keep
them, so a finished draft loads without the target's weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from specdraft.fileio import tmp_path
from specdraft.model.dflash_files import newest_checkpoint
from specdraft.model.draft import CONFIG_FILE, FORMAT, WEIGHTS_FILE, DraftConfig, Eagle3Draft
from specdraft.model.frozen import EmbedSource, load_embeddings
from specdraft.model.published import adopt, is_published, published_config, published_kind, published_state

STATE_FILE = "train_state.pt"  # optimizer, schedule, RNG and data position of a training checkpoint
LATEST_FILE = "latest"  # OUT/checkpoints/latest: the name of the newest complete checkpoint


EMBED_KEY = "embed_tokens.weight"  # the draft's frozen embedding, left out of saves with `embed_from`


def save_draft(
    draft: Eagle3Draft, path: str | Path, extra: dict | None = None, embed_from: EmbedSource | None = None
) -> Path:
    """Write `config.json` + `model.safetensors` (state incl. d2t, t2d, embed_tokens) atomically to `path`.

    With `embed_from` (`FrozenParts.embed_source` of the target the draft's embeddings were copied from),
    the embeddings are not written; config.json records `embed_from` and `load_draft` re-reads them there.
    """
    from safetensors.torch import save_file

    from specdraft import __version__

    path = Path(path)
    tmp = tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    skip = {EMBED_KEY} if embed_from is not None else set()
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in skip}
    meta = {"format": FORMAT, "specdraft_version": __version__, "config": asdict(draft.cfg), **(extra or {})}
    if embed_from is not None:
        meta["embed_tokens"] = embed_from.to_dict()
    try:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        for f in (WEIGHTS_FILE, CONFIG_FILE):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:  # a full disk must not stay full of a partial save: its temporary goes
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    try:
        meta = json.loads(p.read_text())
    except ValueError as e:
        raise ValueError(f"{p} is not readable JSON ({e}): the draft's config is damaged; use another checkpoint "
                         "or train again") from None  # fmt: skip
    if not isinstance(meta, dict):
        raise ValueError(f"{p} is not a draft config (a JSON object): use another checkpoint or train again")
    if meta.get("format") != FORMAT:
        kind = published_kind(meta, p.parent)
        if kind is not None:  # a published EAGLE-3 draft (speculators or EAGLE-3's layout, ours exported too)
            return published_config(meta, kind)
        raise ValueError(f"{p} has format {meta.get('format')!r}: neither a specdraft draft ({FORMAT!r}) nor a "
                         "published EAGLE-3 draft (speculators' Eagle3Speculator or LlamaForCausalLMEagle3)")  # fmt: skip
    return DraftConfig(**meta["config"])


def load_draft_state(
    path: str | Path, target: str | None = None, with_embeddings: bool = True
) -> dict[str, torch.Tensor]:
    """The full state dict of a saved draft, its embeddings re-read from the target when the save left them out.

    `target` overrides the recorded target directory (its weights fingerprint must still match);
    `with_embeddings=False` skips that read (the embeddings are then absent from the returned state).
    """
    from safetensors.torch import load_file

    cfg = load_draft_config(path)  # the clear error for a directory that is no saved draft
    if is_published(path):
        return published_state(path, cfg)
    weights = Path(path) / WEIGHTS_FILE
    try:
        state = load_file(str(weights))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{weights} is missing: the saved draft is incomplete; use another checkpoint"
        ) from None
    except Exception as e:  # safetensors' own error for a damaged header or a cut file, without the path
        raise ValueError(f"{weights} cannot be read ({type(e).__name__}: {e}): the file is damaged; use another "
                         "checkpoint (checkpoints/step_N) or train again") from None  # fmt: skip
    meta = json.loads((Path(path) / CONFIG_FILE).read_text())
    source = meta.get("embed_tokens")
    if source is not None and with_embeddings:
        assert EMBED_KEY not in state, f"{path} records its embeddings as the target's but also holds them"
        try:
            state[EMBED_KEY] = load_embeddings(source, target)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} keeps no copy of its frozen embeddings and cannot read them from its "
                             f"target: {e}") from e  # fmt: skip
    return state


def load_draft(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    target: str | None = None,
    with_embeddings: bool = True,
) -> Eagle3Draft:
    """Load a draft written by `save_draft` (strict: every tensor must match).

    A save without its embeddings reads them from its target (`target` overrides the recorded directory);
    `with_embeddings=False` leaves them NaN instead (for export, which never writes them).
    """
    cfg = load_draft_config(path)
    state = load_draft_state(path, target, with_embeddings)
    draft = Eagle3Draft(cfg)
    if EMBED_KEY not in state:
        state[EMBED_KEY] = torch.full_like(draft.embed_tokens.weight, float("nan"))
    draft.load_state_dict(state, strict=True)
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
    # only the directories training names (step_ and 8 digits): a user's copy `step_00000011_mybackup` is not one
    found = sorted(
        p for p in root.glob("step_*") if re.fullmatch(r"step_\d{8}", p.name) and (p / STATE_FILE).exists()
    )
    return found[-1] if found else None


def draft_dir(path: str | Path) -> Path | None:
    """The saved draft `path` names: itself, its `final/` (training finished), or the newest checkpoint of a
    `specdraft train` output dir (EAGLE-3's, or a DFlash run's written whole); None when it names none."""
    p = Path(path)
    if (p / CONFIG_FILE).exists():
        return p
    if (p / "final" / CONFIG_FILE).exists():
        return p / "final"
    if not (p / "checkpoints").is_dir():
        return None
    return latest_checkpoint(p) or newest_checkpoint(p)


def load_trained(path: str | Path, with_embeddings: bool = True, target=None) -> Eagle3Draft:
    """A draft from a saved draft dir (`final/`, `checkpoints/step_*/`), a `specdraft train` output dir, or a
    published EAGLE-3 draft (speculators format or EAGLE-3's layout; `model.published`).

    A train output dir gives its `final/` draft when training finished, else its newest checkpoint.
    `with_embeddings=False`: see `load_draft` (export does not need them). `target` (a loaded target): a
    published draft takes its embeddings, and its default aux layer ids when the draft records none.
    """
    d = draft_dir(path)
    if d is None:
        raise FileNotFoundError(f"{path} is neither a saved draft dir (with {CONFIG_FILE}) nor a `specdraft train` "
                                "output dir (with final/ or checkpoints/)")  # fmt: skip
    draft = load_draft(d, with_embeddings=with_embeddings)
    if target is not None and is_published(d):
        adopt(draft, target)
    return draft
