"""What a DFlash run is built from: the extraction's shards and target, the draft (fresh, --init-from, or the
checkpoint --resume continues), the data order and the learning-rate schedule.

The draft fuses every aux layer the extraction holds (all its `layer_ids` but the final one, which only
EAGLE-3's teacher reads). `--init-from` takes a saved DFlash draft (a final/, a checkpoints/step_N, or a
train OUT): its weights and draft vocabulary, with a new optimizer and schedule; a draft for another target,
other layers or other block settings is refused, with the fix (as `train.setup.warm_problems` does for EAGLE-3).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.model.dflash_files import (
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    checkpoint_step,
    complete_checkpoints,
    is_dflash_dir,
    load_dflash,
    read_dflash_config,
    write_dflash,
)
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
    vocab_size: int = 0  # the target's vocabulary as the extraction recorded it (0: not recorded)


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
    vocab = tinfo.get("vocab_size")
    return BlockData(ss, aux_ids, lengths, train_sids, val_sids, name, tinfo.get("config_hash") or "",
                     _scored(ss, sids), vocab if isinstance(vocab, int) else 0)  # fmt: skip


def _scored(ss, sids: list[int]) -> int:
    """The loss-masked tokens of `sids`: the dataset's share for them where its manifest records it (as EAGLE-3
    estimates it offline), else every extracted sample's."""
    from specdraft.train.setup import _dataset_manifest

    dm = _dataset_manifest(ss.manifest.get("dataset"))
    if dm.get("num_tokens") and "num_loss_tokens" in dm:
        return round(dm["num_loss_tokens"] * min(1.0, sum(ss.length(s) for s in sids) / dm["num_tokens"]))
    return int(ss.token_counts().sum())


def dflash_dir(path: str) -> Path | None:
    """The saved draft `path` names: itself, its final/, or the newest complete checkpoints/step_N; None for
    none."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    if (p / "final" / "config.json").exists():
        return p / "final"
    ckpts = complete_checkpoints(p)
    return ckpts[-1] if ckpts else None


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
    dc = DFlashConfig(**read_dflash_config(p)["dflash"])
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


def _memory_bytes(device) -> int:
    """The memory of `device` (a GPU's total, else this machine's RAM; 0 when unknown)."""
    try:
        if torch.device(device).type == "cuda":
            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AssertionError):
        return 0


def data_problems(cfg, data: BlockData, device, chunk: int = 64) -> list[str]:
    """The block settings against the data, from metadata alone (before the target loads): a block longer
    than any sample can fill, a mask token outside the vocabulary, a chunk of blocks that cannot fit in memory."""
    out = []
    longest = max(data.lengths.values(), default=0)
    Q = cfg.block_size
    if longest and Q > longest - 1:
        out.append(f"--block-size {Q} is longer than any sample can fill: the longest sample used has {longest} "
                   f"tokens (--max-length {cfg.max_length}), a block needs a token before its anchor and "
                   f"{Q - 1} after it: lower --block-size to at most {longest - 1}")  # fmt: skip
    if data.vocab_size and cfg.mask_token_id >= data.vocab_size:
        out.append(f"--mask-token-id {cfg.mask_token_id} is outside the target's vocabulary of {data.vocab_size} "
                   f"tokens: pass a token id below {data.vocab_size}, or -1 for the last row")  # fmt: skip
    # one chunk of n blocks: its block mask (n Q x (context + n Q) bools) and its logits (n Q x draft vocab,
    # float32, with their softmax and gradient): a lower bound of what a step allocates
    n = min(cfg.anchors, chunk, max(longest - 2, 1))
    rows = n * Q
    need = rows * (longest + rows) + 3 * 4 * rows * (
        data.vocab_size and min(cfg.draft_vocab_size, data.vocab_size)
    )
    have = _memory_bytes(device)
    if have and need > have:
        out.append(f"--block-size {Q} with --anchors {cfg.anchors}: one chunk of {n} blocks needs at least "
                   f"{need / 1e9:.1f} GB, more than the {have / 1e9:.1f} GB of {device}: lower --block-size or "
                   "--anchors")  # fmt: skip
    return out


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


def _window(name: str, path: Path) -> None:
    """Tests: called at each point of a checkpoint's or final/'s writing (the state a kill -9 there leaves)."""


def write_checkpoint(
    out: Path, step: int, draft: DFlashDraft, opt_state: dict, train: dict, keep: int
) -> Path:
    """OUT/checkpoints/step_N, whole (a private temporary renamed when complete: a kill -9, SIGTERM or full disk
    leaves the previous checkpoints as they were), then the oldest complete ones beyond `keep` removed (only
    those, each renamed away before it is deleted); dead writers' temporaries under checkpoints/ go too."""
    from specdraft.fileio import atomic_dir, remove_dead_leftovers, remove_dir
    from specdraft.train.checkpoint import disk_errors_named

    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(root)
    path = root / f"step_{step}"
    if path.exists() and checkpoint_step(path) is None:  # a partial one of an older specdraft, or not ours
        theirs = sorted(
            p.name for p in path.iterdir() if p.name not in ("config.json", WEIGHTS_FILE, OPTIMIZER_FILE)
        )
        if theirs or not path.is_dir():
            raise ValueError(f"train: {path} is in the way of the checkpoint of step {step} and holds files "
                             f"specdraft did not write ({', '.join(theirs) or 'a file'}): move it out of "
                             f"{root}, then resume")  # fmt: skip
    with disk_errors_named(path), atomic_dir(path, _window) as tmp:
        write_dflash(draft, tmp, extra={"train": {"step": step, **train}})
        _window("weights", tmp)
        torch.save(opt_state, tmp / OPTIMIZER_FILE)
    _window("written", path)
    for old in complete_checkpoints(out)[:-keep] if keep > 0 else []:
        remove_dir(old)
        _window("pruned", old)
    return path


def load_optimizer_state(ckpt: Path) -> dict:
    """optimizer.pt of a checkpoint; a missing or unreadable one is one line naming it, with the fix."""
    f = ckpt / OPTIMIZER_FILE
    fix = f"delete {ckpt} to resume from the checkpoint before it (or start in a new OUT directory)"
    try:
        return torch.load(f, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{f} is missing: {fix}") from None
    except Exception as e:  # truncated ("PytorchStreamReader failed ..."), or not a torch file
        raise ValueError(
            f"{f} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): {fix}"
        ) from None


def resume_problems(cfg, data: BlockData, out: Path) -> tuple[Path | None, list[str]]:
    """--resume: (the newest complete checkpoint, the settings that differ from the ones it was written with,
    as EAGLE-3's resume compares them: `fileio.changed_settings` but `train.config._RESUME_FREE`)."""
    from dataclasses import asdict

    from specdraft.fileio import changed_settings
    from specdraft.train.config import _RESUME_FREE, TrainConfig

    ckpts = complete_checkpoints(out)
    if not cfg.resume or not ckpts:
        return None, []
    ck = ckpts[-1]
    meta = read_dflash_config(ck, f"delete {ck} to resume from the checkpoint before it")
    old = meta["train"].get("settings")
    dc = meta["dflash"]
    if not isinstance(old, dict):  # written before checkpoints recorded their settings: the draft's own
        if dc.get("aux_layer_ids") != data.aux_ids or dc.get("block_size") != cfg.block_size:
            return ck, [f"--resume: {ck} is a draft for other layers or block size than these settings and data: "
                        "resume with the settings it was trained with"]  # fmt: skip
        return ck, []
    if "trained_loss" not in meta["train"] and old.get("loss") == "kl":  # written before DFlash read --loss:
        old = {**old, "loss": "ce"}  # it recorded EAGLE-3's default, unused, and trained with ce
    free = {*_RESUME_FREE, "fsdp"}  # --fsdp holds the same weights (a checkpoint resumes with or without it)
    changed = changed_settings(old, asdict(cfg), asdict(TrainConfig()), skip=free)
    if dc.get("aux_layer_ids") != data.aux_ids:
        changed.append(("aux layers", dc.get("aux_layer_ids"), data.aux_ids))
    if not changed:
        return ck, []
    said = ", ".join(f"{k} {a!r} there, {b!r} now" for k, a, b in changed)
    return ck, [f"--resume: {ck} was written with other settings ({said}): resume with the settings it was "
                f"written with ({flags({k: a for k, a, _ in changed if k in old})}), or start in a new OUT "
                "directory"]  # fmt: skip


def start_draft(cfg, data: BlockData, tgt, resumed: Path | None) -> tuple[DFlashDraft, int, str]:
    """(the draft, the step it is at, the --init-from path or ""): --resume's checkpoint `resumed`, else
    --init-from's draft, else a fresh one."""
    if resumed is not None:
        fix = f"delete {resumed} to resume from the checkpoint before it"
        return load_dflash(resumed, fix), read_dflash_config(resumed, fix)["train"]["step"], ""
    if cfg.init_from:  # a trained draft: its weights and vocabulary (not the data's counts); a new optimizer
        p = dflash_dir(cfg.init_from)
        return load_dflash(p), 0, str(p)
    return new_draft(cfg, data, tgt), 0, ""


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
    """(aux (T, n_aux * H), ids (T,), loss_mask (T,), final (T, H)) of one stored sample, truncated to
    max_length (final: the target's last hidden state, a soft --loss's teacher reads it)."""
    return sample_tensors(data, data.ss.load(sid), max_length, device)


def sample_tensors(data: BlockData, d: dict, max_length: int, device) -> tuple:
    """What `load_sample` gives, of a sample dict as the shards (or an online capture) hold it."""
    n = len(data.aux_ids)
    hid = d["hidden"][:max_length].float()  # (T, n_aux + 1, H): the aux slots, then the final one
    T = hid.shape[0]
    return (hid[:, :n].reshape(T, -1).to(device), d["input_ids"][:max_length].long().to(device),
            d["loss_mask"][:max_length].bool().to(device), hid[:, n].to(device) if hid.shape[1] > n else None)  # fmt: skip


def anchor_generator(seed: int, step: int, sid: int) -> torch.Generator:
    """The anchors' random stream of sample `sid` at `step`: the same on any rank (and on --resume)."""
    return torch.Generator().manual_seed(hash((seed, step, sid)) & 0xFFFF_FFFF_FFFF)
