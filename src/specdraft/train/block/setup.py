"""What a DFlash run is built from: the extraction's shards and target, the draft (fresh, --init-from, or the
checkpoint --resume continues), the data order and the learning-rate schedule.

The draft fuses every aux layer the extraction holds (all its `layer_ids` but the final one, which only
EAGLE-3's teacher reads). `--init-from` takes a saved DFlash draft (a final/, a checkpoints/step_N, or a
train OUT): its weights and draft vocabulary, with a new optimizer and schedule; a draft for another target,
other layers or other block settings is refused, with the fix (as `train.setup.warm_problems` does for EAGLE-3).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.model.dflash_files import is_dflash_dir, load_dflash
from specdraft.model.draft import build_vocab_map, vocab_counts
from specdraft.train.batches import split_sids
from specdraft.train.config import flags


@dataclass
class BlockData:
    """The opened shards: samples, their lengths and split, the aux layer ids, the target they came from."""

    ss: object  # specdraft.data.store.ShardSet
    aux_ids: list[int]
    lengths: dict[int, int]  # sample id -> tokens used (truncated to --max-length)
    train_sids: list[int]
    val_sids: list[int]
    target_name: str
    target_hash: str  # the extraction's record of the target's config hash ("" when none)
    scored: int = 0  # loss-masked tokens of the samples used (what `--recipe auto` decides on)


def open_data(shards: str, cfg) -> BlockData:
    """The extraction's shards (several: comma-separated), split into train and validation samples."""
    from specdraft.data.store import ShardSet

    ss = ShardSet.open([p for p in shards.split(",") if p], skip_bad=cfg.skip_bad)
    man = ss.manifest
    tinfo = man["target"]
    name = cfg.target or tinfo.get("path") or tinfo.get("name")
    if not cfg.target and tinfo.get("path") and not Path(tinfo["path"]).exists():
        name = tinfo.get("name")
    sids = ss.sample_ids()[: cfg.max_samples or None]
    lengths = {s: min(ss.length(s), cfg.max_length) for s in sids if ss.length(s) >= 3}
    train_sids, val_sids = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    aux_ids = list(man["layer_ids"])[:-1]  # the final id L is captured for EAGLE-3's teacher only
    return BlockData(ss, aux_ids, lengths, train_sids, val_sids, name, tinfo.get("config_hash") or "",
                     _scored(ss, sids))  # fmt: skip


def _scored(ss, sids: list[int]) -> int:
    """The loss-masked tokens of `sids`: the dataset's share for them where its manifest records it (as EAGLE-3
    estimates it offline), else every extracted sample's."""
    from specdraft.train.setup import _dataset_manifest

    dm = _dataset_manifest(ss.manifest.get("dataset"))
    if dm.get("num_tokens") and "num_loss_tokens" in dm:
        return round(dm["num_loss_tokens"] * min(1.0, sum(ss.length(s) for s in sids) / dm["num_tokens"]))
    return int(ss.token_counts().sum())


def dflash_dir(path: str) -> Path | None:
    """The saved draft `path` names: itself, its final/, or the newest checkpoints/step_N; None for none."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    if (p / "final" / "config.json").exists():
        return p / "final"
    ckpts = sorted((p / "checkpoints").glob("step_*"), key=lambda c: int(c.name[5:]))
    return ckpts[-1] if ckpts and (ckpts[-1] / "config.json").exists() else None


def init_problems(cfg, data: BlockData) -> list[str]:
    """--init-from: a draft these data and settings cannot continue, each with its fix (metadata only)."""
    if not cfg.init_from:
        return []
    p = dflash_dir(cfg.init_from)
    if p is None:
        return [
            f"--init-from {cfg.init_from}: no saved draft there (a final/, checkpoints/step_N, or a train OUT)"
        ]
    if not is_dflash_dir(p):
        return [f"--init-from {p} is not a DFlash draft (an EAGLE-3 one?): pass --init-from a draft trained "
                "with --draft dflash, or train it with --draft eagle3"]  # fmt: skip
    dc = DFlashConfig(**json.loads((p / "config.json").read_text())["dflash"])
    if dc.target_config_hash and data.target_hash and dc.target_config_hash != data.target_hash:
        return [f"--init-from {p} is a draft for another target ({dc.target_name or '?'}, config hash "
                f"{dc.target_config_hash}) than the data's ({data.target_name}, config hash {data.target_hash}): "
                f"pass --init-from a draft trained for {data.target_name}, or drop --init-from to start a fresh "
                "draft"]  # fmt: skip
    errs = []
    if dc.aux_layer_ids != data.aux_ids:
        spelled = " ".join(map(str, dc.aux_layer_ids))
        errs.append(f"--init-from {p} reads aux layers {dc.aux_layer_ids}, the data holds {data.aux_ids}: "
                    f"extract the data again with --layers {spelled} (into a new OUT)")  # fmt: skip
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else dc.vocab_size - 1
    for what, ours, theirs in (("block_size", cfg.block_size, dc.block_size),
                               ("draft_layers", cfg.draft_layers, dc.num_hidden_layers),
                               ("draft_vocab_size", min(cfg.draft_vocab_size, dc.vocab_size), dc.draft_vocab_size),
                               ("mask_token_id", mask_id, dc.mask_token_id),
                               ("train_mask_embedding", cfg.train_mask_embedding, dc.train_mask_embedding)):  # fmt: skip
        if ours != theirs:
            errs.append(f"--init-from {p} was built with {what}={theirs}: pass {flags({what: theirs})} "
                        "(the draft's own setting)")  # fmt: skip
    return errs


def new_draft(cfg, data: BlockData, tgt) -> DFlashDraft:
    """A fresh draft sized like the target: its embedding, head rows and final norm, the data's vocabulary."""
    V = tgt.vocab_size
    dcfg = DFlashConfig.from_target(
        tgt.text_config, data.aux_ids, draft_vocab_size=cfg.draft_vocab_size, num_hidden_layers=cfg.draft_layers,
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id if cfg.mask_token_id >= 0 else V - 1,
        target_name=tgt.name, target_config_hash=tgt.config_hash, train_mask_embedding=cfg.train_mask_embedding,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)  # every rank builds the same draft
    draft = DFlashDraft(dcfg)
    draft.set_vocab(*build_vocab_map(vocab_counts(data.ss.token_counts(), V), dcfg.draft_vocab_size))
    # the target's final norm weight, where its norm is weight * x (Gemma's is (1 + weight) * x: left at ones)
    norm = None if "Gemma" in type(tgt.norm).__name__ else getattr(tgt.norm, "weight", None)
    draft.init_from_target(tgt.embed_tokens.weight.detach().float(), tgt.lm_head.weight.detach().float(),
                           None if norm is None or norm.shape != (dcfg.hidden_size,) else norm.detach().float())  # fmt: skip
    return draft


def checkpoints(out: Path) -> list[Path]:
    """OUT/checkpoints/step_N, oldest first."""
    return sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))


def start_draft(cfg, data: BlockData, tgt, out: Path) -> tuple[DFlashDraft, int, Path | None, str]:
    """(the draft, the step it is at, the checkpoint --resume continues or None, the --init-from path or "")."""
    ckpts = checkpoints(out)
    if cfg.resume and ckpts:
        draft = load_dflash(ckpts[-1])
        if draft.cfg.aux_layer_ids != data.aux_ids or draft.cfg.block_size != cfg.block_size:
            raise ValueError(f"train --resume: {ckpts[-1]} is a draft for other layers or block size than these "
                             "settings and data: resume with the settings it was trained with")  # fmt: skip
        return draft, json.loads((ckpts[-1] / "config.json").read_text())["train"]["step"], ckpts[-1], ""
    if cfg.init_from:  # a trained draft: its weights and vocabulary (not the data's counts); a new optimizer
        p = dflash_dir(cfg.init_from)
        return load_dflash(p), 0, None, str(p)
    return new_draft(cfg, data, tgt), 0, None, ""


def epoch_batches(data: BlockData, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled (seed, epoch) global batches of at most max_tokens tokens (one sample at least)."""
    order = list(data.train_sids)
    random.Random(seed * 1000 + epoch).shuffle(order)
    out, cur, n = [], [], 0
    for s in order:
        if cur and n + data.lengths[s] > max_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += data.lengths[s]
    return out + ([cur] if cur else [])


def extend_plan(plan: list[tuple], data: BlockData, max_tokens: int, seed: int, upto: int) -> list[tuple]:
    """The run's global batches in order, (epoch, index in the epoch, batches in the epoch, sids), extended by
    whole epochs until it holds batch `upto`. Each epoch is shuffled and packed anew, so epochs may differ in
    their number of batches: a step is found by its place in the plan, never by epoch x a fixed count."""
    while len(plan) <= upto:
        e = plan[-1][0] + 1 if plan else 0
        got = epoch_batches(data, max_tokens, seed, e)
        assert got, "an epoch without a batch (the run checks for one at setup)"
        plan += [(e, i, len(got), g) for i, g in enumerate(got)]
    return plan


def load_sample(data: BlockData, sid: int, max_length: int, device) -> tuple:
    """(aux (T, n_aux * H), ids (T,), loss_mask (T,)) of one stored sample, truncated to max_length."""
    return sample_tensors(data, data.ss.load(sid), max_length, device)


def sample_tensors(data: BlockData, d: dict, max_length: int, device) -> tuple:
    """What `load_sample` gives, of a sample dict as the shards (or an online capture) hold it."""
    hid = d["hidden"][
        :max_length, : len(data.aux_ids)
    ].float()  # (T, n_aux, H): the aux slots, not the final one
    T = hid.shape[0]
    return (hid.reshape(T, -1).to(device), d["input_ids"][:max_length].long().to(device),
            d["loss_mask"][:max_length].bool().to(device))  # fmt: skip


def anchor_generator(seed: int, step: int, sid: int) -> torch.Generator:
    """The anchors' random stream of sample `sid` at `step`: the same on any rank (and on --resume)."""
    return torch.Generator().manual_seed(hash((seed, step, sid)) & 0xFFFF_FFFF_FFFF)
