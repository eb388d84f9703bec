"""`specdraft train --draft dflash`: a DFlash draft trained with the block objective on extracted shards.

The same data as EAGLE-3 (an extraction's shards), any captured layer set: the draft fuses every aux layer
the extraction holds (`setup.py`). The same settings where they apply (lr, warmup/schedule as EAGLE-3's,
max_steps, epochs, max_tokens, max_length, val_fraction, log_every, checkpoint_every, keep_checkpoints, seed,
resume, draft_vocab_size), plus the block ones (block_size, draft_layers, anchors, mask_token_id,
train_mask_embedding), and the same machinery:

  - trackers: metrics.jsonl and `--report-to` (tensorboard, wandb, trackio, mlflow) through EAGLE-3's
    `train.metrics.MetricsLog`, with its records (`split` train or val, `step`, loss, acc per block slot,
    tau, blocks; train adds lr, epoch and the global batch's tokens); a resumed run drops the records past
    its checkpoint;
  - `--init-from` a saved DFlash draft (final/, a checkpoint, or a train OUT): its weights and draft
    vocabulary with a new optimizer and schedule; one for another target, other aux layers or other block
    settings is refused with the fix;
  - `torchrun` data parallel (gloo on CPU, NCCL on GPU): each rank trains on a disjoint share of every
    global batch (rank r: its samples r, r + world, ...), the loss is divided by the global batch's loss
    weight, gradients are summed over ranks, so N processes train the weights one process trains with the
    same --max-tokens; anchors are a function of (seed, step, sample), not of the rank. Rank 0 writes.

Refused, not ignored: `--fsdp` (a DFlash draft is a few layers: every rank holds it whole), `--online` and
`--steps-per-batch` (EAGLE-3 only for now).

OUT holds metrics.jsonl, checkpoints/step_N (the draft, the optimizer and the step: resume is exact because
the data order and the anchors are functions of (seed, step)), and final/ (the draft,
`specdraft.model.dflash_files` format).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specdraft.model.dflash import DFlashDraft
from specdraft.model.dflash_files import save_dflash
from specdraft.train.block.objective import BlockStats, batch_loss, evaluate, sample_anchors
from specdraft.train.block.setup import (
    BlockData,
    anchor_generator,
    checkpoints,
    epoch_batches,
    init_problems,
    load_sample,
    open_data,
    start_draft,
)
from specdraft.train.distributed import _all_sum, _init_distributed, barrier
from specdraft.train.metrics import MetricsLog

# settings --draft dflash refuses away from their default, and why
UNSUPPORTED = {
    "online": (False, "EAGLE-3 only for now: extract the data first"),
    "fsdp": (False, "a DFlash draft is a few layers, each rank holds it whole: run torchrun without --fsdp"),
    "steps_per_batch": (1, "EAGLE-3 only for now"),
}
CHUNK = 64  # anchors per activation-checkpointed chunk (`objective.block_loss`)


def block_problems(cfg) -> list[str]:
    """Settings `--draft dflash` does not take (yet), each named, and the user errors shared with EAGLE-3."""
    out = [f"--draft dflash does not support --{k.replace('_', '-')} {getattr(cfg, k)!r}: {why}"
           for k, (v, why) in UNSUPPORTED.items() if getattr(cfg, k) != v]  # fmt: skip
    if cfg.block_size < 2:
        out.append(f"--block-size must be >= 2 (the anchor and one mask slot), not {cfg.block_size}")
    if cfg.draft_layers < 1 or cfg.anchors < 1:
        out.append("--draft-layers and --anchors must be >= 1")
    # EAGLE-3's checks (--report-to among them); --init-from is checked against the data (`init_problems`)
    return out + [p for p in replace(cfg, init_from="", fsdp=False).problems() if p not in out]


def _out_problems(out: Path, resume: bool) -> list[str]:
    """OUT against --resume, as EAGLE-3's `train` checks it: continue a run's checkpoints or start in a new OUT."""
    ckpts = checkpoints(out)
    if ckpts and not resume:
        return [f"{out} already holds checkpoints (newest {ckpts[-1].name}): pass --resume to continue, or "
                "choose another OUT directory"]  # fmt: skip
    return [f"--resume: no checkpoint under {out}/checkpoints to resume from"] if resume and not ckpts else []


@dataclass
class _BlockRun:
    """What setup builds once and every phase reads."""

    cfg: object  # TrainConfig
    out: Path
    rank: int
    world: int
    device: torch.device
    data: BlockData
    draft: DFlashDraft
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    lr_at: object  # step -> learning-rate factor (EAGLE-3's schedule: `train.setup._lr_lambda`)
    per_epoch: int
    total: int
    start: int  # the step the run starts at (the checkpoint's on --resume)
    resumed: Path | None  # the checkpoint --resume continues
    init_from: str  # the --init-from draft ("" when none)


def _build(shards: str, out: Path, cfg) -> _BlockRun:
    """Processes, data, target, the draft (fresh, --init-from, or the checkpoint), optimizer, schedule."""
    from specdraft.model.frozen import load_frozen
    from specdraft.runtime import resolve_device
    from specdraft.train.setup import _lr_lambda

    rank, world, device = _init_distributed(resolve_device(cfg.device, "train"))
    data = open_data(shards, cfg)
    problems = init_problems(cfg, data)
    if problems:
        raise ValueError("train: " + "; ".join(problems))
    tgt = load_frozen(
        data.target_name, device="cpu", dtype="float32", trust_remote_code=cfg.trust_remote_code
    )
    if data.target_hash and tgt.config_hash != data.target_hash:
        raise ValueError(f"train: the target {data.target_name} is not the one the shards were extracted from: "
                         "pass --target with the extraction's model")  # fmt: skip
    draft, start, resumed, init_from = start_draft(cfg, data, tgt, out)
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if resumed is not None:
        opt.load_state_dict(torch.load(resumed / "optimizer.pt", weights_only=True))
    per_epoch = len(epoch_batches(data, cfg.max_tokens, cfg.seed, 0))
    if per_epoch == 0:
        raise ValueError(f"train: no training batch: {len(data.train_sids)} training samples of length >= 3; "
                         "add data or lower --val-fraction")  # fmt: skip
    total = cfg.max_steps or per_epoch * cfg.epochs
    return _BlockRun(cfg, out, rank, world, device, data, draft, params, opt, _lr_lambda(cfg, total), per_epoch,
                     total, start, resumed, init_from)  # fmt: skip


def _global(run: _BlockRun, st: BlockStats) -> BlockStats:
    """The stats summed over every rank (this rank's in one process)."""
    return BlockStats.from_tensor(st.Q, _all_sum(st.as_tensor())) if run.world > 1 else st


def _load(run: _BlockRun, sids: list[int]) -> list[tuple]:
    return [load_sample(run.data, s, run.cfg.max_length, run.device) for s in sids]


def _backward_step(run: _BlockRun, loss: torch.Tensor | None, weight: float) -> None:
    """Backward of this rank's loss over the global loss weight, gradients summed over ranks, clip, step."""
    run.opt.zero_grad(set_to_none=True)
    if weight <= 0:  # nothing labelled in the whole global batch: no rank steps
        return
    if loss is not None:
        (loss / weight).backward()
    if run.world > 1:  # one all-reduce of every gradient (zeros for a rank without samples)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in run.params]
        flat = _all_sum(torch.cat([g.flatten() for g in grads]))
        for p, g in zip(run.params, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p).clone()
    torch.nn.utils.clip_grad_norm_(run.params, 1.0)
    run.opt.step()


def _validate(run: _BlockRun, log: MetricsLog, step: int) -> dict:
    """Every held-out sample (each rank its share), every valid anchor up to --anchors: recorded, returned."""
    st = BlockStats(run.draft.cfg.block_size)
    for s in run.data.val_sids[run.rank :: run.world]:
        st.add(evaluate(run.draft, _load(run, [s]), anchors_per_seq=run.cfg.anchors))
    val = _global(run, st).summary()
    log({"split": "val", "step": step, **val})
    return val


def _checkpoint(run: _BlockRun, step: int) -> Path:
    """checkpoints/step_N (the draft, the optimizer, the step), the oldest beyond --keep-checkpoints removed."""
    import shutil

    path = run.out / "checkpoints" / f"step_{step}"
    if run.rank == 0:
        save_dflash(run.draft, path, extra={"train": {"step": step}})
        torch.save(run.opt.state_dict(), path / "optimizer.pt")
        for p in checkpoints(run.out)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(p, ignore_errors=True)
    barrier(run.world)
    return path


def _print_header(run: _BlockRun) -> None:
    dc = run.draft.cfg
    n = sum(p.numel() for p in run.params) / 1e6
    src = f", from {run.init_from}" if run.init_from else ""
    print(f"train: DFlash draft, {len(dc.aux_layer_ids)} target layers {dc.aux_layer_ids}, block {dc.block_size}, "
          f"{dc.num_hidden_layers} layer(s), {n:.2f}M trained params{src}, {len(run.data.train_sids)} train / "
          f"{len(run.data.val_sids)} val samples, {run.total} steps, {run.world} rank(s)", flush=True)  # fmt: skip


def train_dflash(shards: str, out: str | Path, cfg, _stop_at: int | None = None) -> Path:
    """Train a DFlash draft on extracted shards; returns OUT/final. `_stop_at` ends the run after that step
    without writing final/ (tests: an interrupted run to resume)."""
    # --- check: the settings --draft dflash takes (the --init-from draft is checked against the data in setup)
    problems = block_problems(cfg) + _out_problems(Path(out), cfg.resume)
    if problems:
        raise ValueError("train: " + "; ".join(problems))

    # --- setup: processes, data, target, draft (fresh, --init-from, or --resume's checkpoint), optimizer ---
    run = _build(shards, Path(out), cfg)

    # --- logging: metrics.jsonl and the --report-to trackers (rank 0 writes) ---
    log = MetricsLog(run.out, run.rank, run.resumed is not None, run.start, cfg.tensorboard, cfg.report_to,
                     asdict(cfg), cfg.project, cfg.run_name)  # fmt: skip
    if run.rank == 0:
        _print_header(run)
    if run.start == 0:
        _validate(run, log, 0)

    # --- the loop ---
    for step in range(run.start, run.total):
        # data: this rank's share of the step's global batch (its samples rank, rank + world, ...)
        epoch, i = divmod(step, run.per_epoch)
        group = epoch_batches(run.data, cfg.max_tokens, cfg.seed, epoch)[i]
        mine = group[run.rank :: run.world]
        batch = _load(run, mine)

        # forward: each sample's anchors (a function of seed, step and sample: any rank draws the same), the
        # summed block losses; the global batch's stats (their loss weight divides every rank's loss)
        anchors = [sample_anchors(lm, cfg.anchors, anchor_generator(cfg.seed, step, s))
                   for s, (_, _, lm) in zip(mine, batch)]  # fmt: skip
        loss, st = batch_loss(run.draft, batch, anchors, CHUNK)
        st = _global(run, st)

        # backward, gradients summed over ranks, clip, step at this step's learning rate
        for g in run.opt.param_groups:
            g["lr"] = cfg.lr * run.lr_at(step)
        _backward_step(run, loss, st.weight)

        # log: the global batch's loss, accuracy per block slot, tau
        if (step + 1) % cfg.log_every == 0 or step + 1 == run.total:
            log({"split": "train", "step": step + 1, "epoch": round((step + 1) / run.per_epoch, 4),
                 "lr": run.opt.param_groups[0]["lr"], "tokens": sum(run.data.lengths[s] for s in group),
                 **st.summary()})  # fmt: skip

        # checkpoint (and stop here when a test interrupts the run)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 in (run.total, _stop_at):
            path = _checkpoint(run, step + 1)
            if step + 1 == _stop_at:
                log.close()
                return path

    # --- end: final validation, final/ (rank 0) ---
    val = _validate(run, log, run.total)
    final = run.out / "final"
    if run.rank == 0:
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in val["acc"])
        print(f"train: validation: tau {val['tau']:.2f}, accuracy per block slot {acc}")
        extra = {"step": run.total, "val": val, **({"init_from": run.init_from} if run.init_from else {})}
        save_dflash(run.draft, final, extra={"train": extra})
    log.close()
    barrier(run.world)
    return final
