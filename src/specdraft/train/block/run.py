"""`specdraft train --draft dflash`: a DFlash draft trained with the block objective on extracted shards.

The same data as EAGLE-3 (an extraction's shards, checked as `train` checks them), any captured layer set:
the draft fuses every aux layer the extraction holds (all its `layer_ids` but the final one, which only
EAGLE-3's teacher reads). The same settings where they apply (lr, warmup/schedule, max_steps, epochs,
max_tokens, max_length, val_fraction, checkpoint_every, keep_checkpoints, seed, resume, draft_vocab_size),
plus the block ones (block_size, draft_layers, anchors, mask_token_id, train_mask_embedding). Single process; torchrun/FSDP,
online capture and trackers are EAGLE-3 only for now (refused here, not ignored).

OUT holds metrics.jsonl (loss, per-slot accuracy, tau per logged step; validation rows), checkpoints/step_N
(the draft, the optimizer and the step: resume is exact because the data order and the anchors are
functions of (seed, step)), and final/ (the draft, `specdraft.model.dflash_files` format).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.model.dflash_files import load_dflash, save_dflash
from specdraft.model.draft import build_vocab_map
from specdraft.train.batches import split_sids
from specdraft.train.block.objective import BlockStats, evaluate, train_step

UNSUPPORTED = {"online": False, "fsdp": False, "init_from": "", "steps_per_batch": 1}


def block_problems(cfg) -> list[str]:
    """Settings `--draft dflash` does not take (yet), each named."""
    out = [f"--draft dflash does not support --{k.replace('_', '-')} {getattr(cfg, k)!r} yet"
           for k, v in UNSUPPORTED.items() if getattr(cfg, k) != v]  # fmt: skip
    if cfg.block_size < 2:
        out.append(f"--block-size must be >= 2 (the anchor and one mask slot), not {cfg.block_size}")
    if cfg.draft_layers < 1 or cfg.anchors < 1:
        out.append("--draft-layers and --anchors must be >= 1")
    return out


def _batches(
    sids: list[int], lengths: dict[int, int], max_tokens: int, seed: int, epoch: int
) -> list[list[int]]:
    """Shuffled (seed, epoch) groups of samples of at most max_tokens tokens (one sample at least)."""
    order = list(sids)
    random.Random(seed * 1000 + epoch).shuffle(order)
    out, cur, n = [], [], 0
    for s in order:
        if cur and n + lengths[s] > max_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += lengths[s]
    return out + ([cur] if cur else [])


def _sample(ss, sid: int, n_aux: int, max_length: int, device) -> tuple:
    """(aux (T, n_aux * H), ids (T,), loss_mask (T,)) of one stored sample, truncated to max_length."""
    d = ss.load(sid)
    hid = d["hidden"][:max_length, :n_aux].float()  # (T, n_aux, H): the aux slots, not the final one
    T = hid.shape[0]
    return (hid.reshape(T, -1).to(device), d["input_ids"][:max_length].long().to(device),
            d["loss_mask"][:max_length].bool().to(device))  # fmt: skip


def _lr(cfg, step: int, total: int) -> float:
    import math

    warm = max(1, round(cfg.warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    p = (step - warm) / max(1, total - warm)
    lo = cfg.min_lr_ratio
    return lo + (1 - lo) * (0.5 * (1 + math.cos(math.pi * p)) if cfg.schedule == "cosine" else 1 - p)


def _log(out: Path, row: dict) -> None:
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def train_dflash(shards: str, out: str | Path, cfg, _stop_at: int | None = None) -> Path:
    """Train a DFlash draft on extracted shards; returns OUT/final. `_stop_at` ends the run after that step
    without writing final/ (tests: an interrupted run to resume)."""
    from specdraft.data.store import ShardSet
    from specdraft.model.frozen import load_frozen

    problems = block_problems(cfg)
    if problems:
        raise ValueError("train: " + "; ".join(problems))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if cfg.device in ("auto", "cpu") and not torch.cuda.is_available() else
                          ("cuda" if cfg.device == "auto" else cfg.device))  # fmt: skip
    ss = ShardSet.open([p for p in shards.split(",") if p], skip_bad=cfg.skip_bad)
    man = ss.manifest
    layer_ids = list(man["layer_ids"])
    aux_ids = layer_ids[:-1]  # the final id L is captured for EAGLE-3's teacher only
    tinfo = man["target"]
    name = cfg.target or tinfo.get("path") or tinfo.get("name")
    if not cfg.target and tinfo.get("path") and not Path(tinfo["path"]).exists():
        name = tinfo.get("name")
    tgt = load_frozen(name, device="cpu", dtype="float32", trust_remote_code=cfg.trust_remote_code)
    if tinfo.get("config_hash") and tgt.config_hash != tinfo["config_hash"]:
        raise ValueError(f"train: the target {name} is not the one the shards were extracted from "
                         f"({tinfo.get('name')}): pass --target with the extraction's model")  # fmt: skip
    sids = ss.sample_ids()[: cfg.max_samples or None]
    lengths = {s: min(ss.length(s), cfg.max_length) for s in sids if ss.length(s) >= 3}
    train_sids, val_sids = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    V = tgt.vocab_size
    dcfg = DFlashConfig.from_target(
        tgt.text_config, aux_ids, draft_vocab_size=cfg.draft_vocab_size, num_hidden_layers=cfg.draft_layers,
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id if cfg.mask_token_id >= 0 else V - 1,
        target_name=tgt.name, target_config_hash=tgt.config_hash, train_mask_embedding=cfg.train_mask_embedding,
    )  # fmt: skip
    ckpts = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    start = 0
    if cfg.resume and ckpts:
        draft = load_dflash(ckpts[-1])
        if draft.cfg.aux_layer_ids != aux_ids or draft.cfg.block_size != cfg.block_size:
            raise ValueError(f"train --resume: {ckpts[-1]} is a draft for other layers or block size than these "
                             "settings and data: resume with the settings it was trained with")  # fmt: skip
        start = json.loads((ckpts[-1] / "config.json").read_text())["train"]["step"]
    else:
        torch.manual_seed(cfg.seed)
        draft = DFlashDraft(dcfg)
        d2t, t2d = build_vocab_map(ss.token_counts(), dcfg.draft_vocab_size)
        draft.set_vocab(d2t, t2d)
        # the target's final norm weight, where its norm is weight * x (Gemma's is (1 + weight) * x: left at ones)
        norm = None if "Gemma" in type(tgt.norm).__name__ else getattr(tgt.norm, "weight", None)
        draft.init_from_target(tgt.embed_tokens.weight.detach().float(), tgt.lm_head.weight.detach().float(),
                               None if norm is None or norm.shape != (dcfg.hidden_size,) else norm.detach().float())  # fmt: skip
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if start:
        opt.load_state_dict(torch.load(ckpts[-1] / "optimizer.pt", weights_only=True))
    per_epoch = len(_batches(train_sids, lengths, cfg.max_tokens, cfg.seed, 0))
    total = cfg.max_steps or per_epoch * cfg.epochs
    n_aux = len(aux_ids)

    def load(group):
        return [_sample(ss, s, n_aux, cfg.max_length, device) for s in group]

    def validate(step: int) -> dict:
        st = BlockStats(dcfg.block_size)
        for s in val_sids:
            st.add(evaluate(draft, load([s]), anchors_per_seq=cfg.anchors))
        row = {"step": step, "val": st.summary()}
        _log(out, row)
        return row["val"]

    if start == 0:
        print(f"train: DFlash draft, {n_aux} target layers {aux_ids}, block {dcfg.block_size}, "
              f"{dcfg.num_hidden_layers} layer(s), {sum(p.numel() for p in params) / 1e6:.2f}M trained params, "
              f"{total} steps")  # fmt: skip
        validate(0)
    for step in range(start, total):
        epoch, i = divmod(step, per_epoch)
        group = _batches(train_sids, lengths, cfg.max_tokens, cfg.seed, epoch)[i]
        for g in opt.param_groups:
            g["lr"] = cfg.lr * _lr(cfg, step, total)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        st = train_step(draft, opt, load(group), cfg.anchors, chunk=64, generator=gen)
        if (step + 1) % cfg.log_every == 0:
            _log(out, {"step": step + 1, "lr": opt.param_groups[0]["lr"], **st.summary()})
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total or step + 1 == _stop_at:
            d = save_dflash(
                draft, out / "checkpoints" / f"step_{step + 1}", extra={"train": {"step": step + 1}}
            )
            torch.save(opt.state_dict(), d / "optimizer.pt")
            old = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
            for p in old[: -cfg.keep_checkpoints]:
                shutil.rmtree(p, ignore_errors=True)
        if step + 1 == _stop_at:
            return out / "checkpoints" / f"step_{step + 1}"
    val = validate(total)
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in val["acc"])
    print(f"train: validation: tau {val['tau']:.2f}, accuracy per block slot {acc}")
    return save_dflash(draft, out / "final", extra={"train": {"step": total, "val": val}})
