"""--init-from: a new run that starts from a trained draft instead of a fresh one.

For a team that has a finished draft and more data: the new run takes the draft's weights and its draft
vocabulary (chosen by the first run's token counts; the new data's counts do not change it), and trains with a
new optimizer, schedule and EMA. `--resume` is another thing: it continues one run exactly, on its own data.

What must agree with the draft is checked twice: the settings before anything loads (`init_problems`, among
all of TrainConfig's problems), the target and its layers once the data is open (`warm_draft`).
"""

from __future__ import annotations

from pathlib import Path

from specdraft.model.checkpoint import latest_checkpoint, load_draft, load_draft_config
from specdraft.model.draft import CONFIG_FILE, DraftConfig, Eagle3Draft


def resolve(path: str) -> Path | None:
    """The saved draft `path` names: itself, its `final/`, or the newest checkpoint of a train OUT."""
    p = Path(path)
    if (p / CONFIG_FILE).exists():
        return p
    if (p / "final" / CONFIG_FILE).exists():
        return p / "final"
    return latest_checkpoint(p) if (p / "checkpoints").is_dir() else None


def init_problems(cfg) -> list[str]:
    """The settings' disagreements with the --init-from draft (each with its fix); [] without --init-from."""
    if not cfg.init_from:
        return []
    p = resolve(cfg.init_from)
    if p is None:
        return [
            f"--init-from {cfg.init_from}: no saved draft there (a final/, checkpoints/step_N, or a train OUT)"
        ]
    try:
        dc: DraftConfig = load_draft_config(p)
    except (OSError, ValueError) as e:
        return [f"--init-from {cfg.init_from}: {e}"]
    errs = []
    if dc.draft_vocab_size != cfg.draft_vocab_size:
        errs.append(f"--init-from {p} has a draft vocabulary of {dc.draft_vocab_size} tokens: pass "
                    f"--draft-vocab-size {dc.draft_vocab_size} (the vocabulary is the draft's)")  # fmt: skip
    if dc.norm_before_residual != cfg.norm_before_residual:
        flag = "--norm-before-residual" if dc.norm_before_residual else "--no-norm-before-residual"
        errs.append(
            f"--init-from {p} was built with norm_before_residual={dc.norm_before_residual}: pass {flag}"
        )
    return errs


def warm_draft(path: str, target, aux_layer_ids: list[int]) -> tuple[Eagle3Draft, str]:
    """The --init-from draft for this target and these aux layers (float32, embeddings frozen), and its path."""
    p = resolve(path)
    assert p is not None, "init_problems vets the path before setup"
    dc = load_draft_config(p)
    errs = []
    if dc.target_config_hash and target.config_hash and dc.target_config_hash != target.config_hash:
        errs.append(f"it was trained for another target (config hash {dc.target_config_hash}; the data's target "
                    f"has {target.config_hash}): start a fresh run, or train on this target's hidden states")  # fmt: skip
    if list(dc.aux_layer_ids) != list(aux_layer_ids):
        errs.append(f"it reads aux layers {list(dc.aux_layer_ids)}, the data holds {list(aux_layer_ids)}: "
                    f"extract with --layers {' '.join(map(str, dc.aux_layer_ids))}")  # fmt: skip
    if dc.hidden_size != target.hidden_size or dc.vocab_size != target.vocab_size:
        errs.append(f"its sizes (hidden {dc.hidden_size}, vocab {dc.vocab_size}) are not the target's "
                    f"(hidden {target.hidden_size}, vocab {target.vocab_size})")  # fmt: skip
    if errs:
        raise ValueError(f"train --init-from {p}: " + "; ".join(errs))
    return load_draft(p), str(p)
