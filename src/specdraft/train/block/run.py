"""`specdraft train --draft dflash`: a DFlash draft trained with the block objective on extracted shards (or
captured online).

The same data as EAGLE-3 (an extraction's shards), any captured layer set: the draft fuses every aux layer
the extraction holds (`setup.py`). The same settings where they apply (lr, warmup/schedule as EAGLE-3's,
max_steps, epochs, max_tokens, max_length, val_fraction, log_every, checkpoint_every, keep_checkpoints, seed,
resume, draft_vocab_size), plus the block ones (block_size, draft_layers, anchors, mask_token_id,
train_mask_embedding), and the same machinery:

  - trackers: metrics.jsonl and `--report-to` (tensorboard, wandb, trackio, mlflow) through EAGLE-3's
    `train.report.metrics.MetricsLog`, with its records (`split` train or val, `step`, loss, acc per block slot,
    tau, blocks; train adds lr, epoch and the global batch's tokens); a resumed run drops the records past
    its checkpoint;
  - `--init-from` a saved DFlash draft (final/, a checkpoint, or a train OUT): its weights and draft
    vocabulary with a new optimizer and schedule; one for another target, other aux layers or other block
    settings is refused with the fix;
  - `torchrun` data parallel (gloo on CPU, NCCL on GPU): each rank trains on a disjoint share of every
    global batch (rank r: its samples r, r + world, ...), the loss is divided by the global batch's loss
    weight, gradients are summed over ranks, so N processes train the weights one process trains with the
    same --max-tokens; anchors are a function of (seed, step, sample), not of the rank. Rank 0 writes.
    Every rank holds the draft whole and gradients are all-reduced, or with `--fsdp` its trainable weights
    and their AdamW moments are sharded by FSDP2 `fully_shard` (`sharded.py`: the frozen embedding and LM
    head rows stay whole on every rank) and gradients are reduce-scattered: the same sums, the same weights;
  - `--steps-per-batch N`: N optimizer steps per batch, as EAGLE-3's (there each on the next 1/N of every
    row's scored tokens): each sequence's anchors, sampled once per batch, are cut in position order into N
    contiguous groups (`torch.tensor_split`), step j training on the blocks of group j, each block seeing
    the whole context before its anchor. The step counter, the schedule, --max-steps, the records and the
    checkpoints count optimizer steps (N per batch: an epoch is batches x N steps); the anchors are drawn
    at the batch's first step; a record's `tokens` is the step's share of its batch's
    (`train.batches.part_share`); a run stopped mid-batch resumes exactly.

`--online` (`online.py`): DATA is a prepared dataset and the target captures each batch's hidden states
(`--layers`, any set; transformers in process or `--backend vllm`, as EAGLE-3's online training). The
small-run recipe (`--recipe`, train.config.DFLASH_SMALL_RUN: its lr, tokens a step and schedule, block 4 and
16 anchors; an --init-from draft keeps its block size) fills the
settings not given under 500k scored tokens, as for EAGLE-3.

OUT holds metrics.jsonl, checkpoints/step_N (the draft, the optimizer and the step: resume is exact because
the data order and the anchors are functions of (seed, step); one written under --fsdp holds the full draft
and optimizer, as one process writes them, and resumes with or without --fsdp), and final/ (the draft,
`specdraft.model.dflash_files` format).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specdraft.model.dflash import DFlashDraft
from specdraft.model.dflash_files import write_dflash
from specdraft.train.batches import part_share
from specdraft.train.block import setup as block_setup
from specdraft.train.block.objective import BlockStats, Objective, sample_anchors
from specdraft.train.block.online import open_online
from specdraft.train.block.setup import (
    BlockData,
    anchor_generator,
    complete_checkpoints,
    data_problems,
    epoch_batches,
    extend_plan,
    init_problems,
    load_optimizer_state,
    load_sample,
    open_data,
    resume_problems,
    sample_tensors,
    start_draft,
    write_checkpoint,
)
from specdraft.train.block.sharded import BlockModel, full_states, load_optimizer, wrap
from specdraft.train.checkpoint import check_weights
from specdraft.train.config import DFLASH_SMALL_RUN, with_own_loss, with_recipe
from specdraft.train.distributed import _all_sum, _init_distributed, barrier, leaving_process_group
from specdraft.train.optim import make_optimizer
from specdraft.train.report.metrics import MetricsLog

# settings --draft dflash refuses away from their default, and why (none today: the table stays for the next)
UNSUPPORTED: dict[str, tuple[object, str]] = {}
CHUNK = 64  # anchors per activation-checkpointed chunk (`objective.block_loss`)


def block_problems(cfg) -> list[str]:
    """Settings `--draft dflash` does not take (yet), each named, and the user errors shared with EAGLE-3."""
    out = [f"--draft dflash does not support --{k.replace('_', '-')} {getattr(cfg, k)!r}: {why}"
           for k, (v, why) in UNSUPPORTED.items() if getattr(cfg, k) != v]  # fmt: skip
    if cfg.block_size < 2:
        out.append(f"--block-size must be >= 2 (the anchor and one mask slot), not {cfg.block_size}")
    if cfg.anchors < 1:  # --draft-layers: EAGLE-3's check (`TrainConfig.problems`)
        out.append(f"--anchors must be at least 1, not {cfg.anchors}")
    if cfg.block_size >= cfg.max_length >= 3:
        out.append(f"--block-size {cfg.block_size} must be below --max-length {cfg.max_length}: a block is its anchor "
                   f"(after a sample's first token) and the {cfg.block_size - 1} tokens after it; lower --block-size "
                   "or raise --max-length")  # fmt: skip
    if cfg.mask_token_id < -1:
        out.append(f"--mask-token-id must be a token id of the target (0 .. vocabulary - 1), or -1 for its last "
                   f"row, not {cfg.mask_token_id}")  # fmt: skip
    # EAGLE-3's checks (--report-to among them); --init-from is checked against the data (`init_problems`)
    return out + [p for p in replace(cfg, init_from="", fsdp=False).problems() if p not in out]


def _out_problems(out: Path, resume: bool) -> list[str]:
    """OUT against --resume, as EAGLE-3's `train` checks it: continue a run's checkpoints or start in a new OUT;
    an OUT holding files training did not write is refused (`train.checkpoint.foreign_problem`)."""
    from specdraft.train.checkpoint import foreign_problem

    theirs = foreign_problem(out)
    if theirs:
        return theirs
    ckpts = complete_checkpoints(out)
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
    model: BlockModel  # the draft behind one call per step (FSDP2-sharded under --fsdp with several ranks)
    sharded: bool
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    lr_at: object  # step -> learning-rate factor (EAGLE-3's schedule: `train.setup._lr_lambda`)
    plan: list[
        tuple
    ]  # the global batches in order: (epoch, index, batches in that epoch, sids) (`extend_plan`)
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
    data = open_online(shards, cfg, device) if cfg.online else open_data(shards, cfg)
    # (an --init-from draft keeps its own block size: the recipe does not fill it there)
    recipe = {k: v for k, v in DFLASH_SMALL_RUN.items() if not (cfg.init_from and k == "block_size")}
    cfg, said = with_recipe(cfg, data.scored, recipe)
    if said and rank == 0:
        print(said, flush=True)
    # every check that needs only metadata (the data, the --init-from draft, --resume's checkpoint and the
    # settings it was written with) before the target loads, and before anything is written
    resumed, problems = resume_problems(cfg, data, out)
    problems = data_problems(cfg, data, device) + init_problems(cfg, data) + problems
    if problems:
        raise ValueError("train: " + "; ".join(problems))
    tgt = load_frozen(
        data.target_name, device="cpu", dtype="float32", trust_remote_code=cfg.trust_remote_code
    )
    if data.target_hash and tgt.config_hash != data.target_hash:
        raise ValueError(f"train: the target {data.target_name} is not the one the shards were extracted from: "
                         "pass --target with the extraction's model")  # fmt: skip
    draft, start, init_from = start_draft(cfg, data, tgt, resumed)
    sharded = cfg.fsdp and world > 1
    model = wrap(draft.to(device), sharded, objective(cfg, tgt, draft))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = make_optimizer(named, cfg.optimizer, cfg.lr, cfg.weight_decay)
    if resumed is not None:
        load_optimizer(model, opt, load_optimizer_state(resumed), sharded)
    if not epoch_batches(data, cfg.max_tokens, cfg.seed, 0):
        raise ValueError(f"train: no training batch: {len(data.train_sids)} training samples of length >= 3; "
                         "add data or lower --val-fraction")  # fmt: skip
    plan = extend_plan([], data, cfg.max_tokens, cfg.seed, 0)
    while plan[-1][0] < cfg.epochs - 1:  # every batch of --epochs epochs (their counts may differ)
        extend_plan(plan, data, cfg.max_tokens, cfg.seed, len(plan))
    total = cfg.max_steps or len(plan) * cfg.steps_per_batch
    return _BlockRun(cfg, out, rank, world, device, data, draft, model, sharded, params, opt,
                     _lr_lambda(cfg, total), plan, total, start, resumed, init_from)  # fmt: skip


def objective(cfg, tgt, draft) -> Objective:
    """The slot loss of --position-weights and --loss; for a soft loss, the target's frozen final norm and head
    over the draft's vocabulary as the teacher (EAGLE-3's `TeacherHead`)."""
    from specdraft.train.losses import BLOCK_LOSSES, parse_loss
    from specdraft.train.ttt import TeacherHead

    terms = parse_loss(cfg.loss, BLOCK_LOSSES)
    teacher = None if set(terms) <= {"ce"} else TeacherHead(tgt, draft.t2d.cpu()).to(draft.t2d.device)
    return Objective(cfg.position_weights, terms, teacher)


def _global(run: _BlockRun, st: BlockStats) -> BlockStats:
    """The stats summed over every rank (this rank's in one process)."""
    return BlockStats.from_tensor(st.Q, _all_sum(st.as_tensor())) if run.world > 1 else st


def _load(run: _BlockRun, sids: list[int]) -> list[tuple]:
    """This rank's samples `sids`: read from the shards, or captured in one call (--online; every rank calls in
    step, an empty share included: rank 0's vLLM engine captures every rank's rows)."""
    ss = run.data.ss
    if not hasattr(ss, "load_rows"):
        return [load_sample(run.data, s, run.cfg.max_length, run.device) for s in sids]
    return [sample_tensors(run.data, d, run.cfg.max_length, run.device) for d in ss.load_rows(sids)]


def _backward_step(run: _BlockRun, loss: torch.Tensor, weight: float) -> None:
    """Backward of this rank's loss over the global loss weight, gradients summed over ranks (reduce-scattered
    by FSDP2 in backward under --fsdp), clip, step."""
    run.opt.zero_grad(set_to_none=True)
    if weight <= 0:  # nothing labelled in the whole global batch: no rank steps
        if run.sharded:
            run.model.reshard()  # the forward's gathered weights, freed without a backward
        return
    (loss / weight).backward()
    if run.world > 1 and not run.sharded:  # one all-reduce of every gradient (zeros for a sample-less rank)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in run.params]
        flat = _all_sum(torch.cat([g.flatten() for g in grads]))
        for p, g in zip(run.params, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p).clone()
    torch.nn.utils.clip_grad_norm_(run.params, 1.0)
    run.opt.step()


@dataclass
class _Held:
    """The batch loaded for its --steps-per-batch steps: its first step, its samples, their anchors."""

    first: int = -1
    batch: list[tuple] = field(default_factory=list)
    anchors: list[torch.Tensor] = field(default_factory=list)


def _step_data(run: _BlockRun, step: int, held: _Held) -> tuple[list[int], int, list[torch.Tensor]]:
    """(the global batch of optimizer step `step`, its part j of --steps-per-batch N, this rank's anchors of
    part j): each sample's anchors are drawn once per batch (a function of seed, the batch's first step and
    the sample: any rank, any part, a resumed run draws the same) and cut in position order into N groups."""
    n = run.cfg.steps_per_batch
    b, part = divmod(step, n)
    group = extend_plan(run.plan, run.data, run.cfg.max_tokens, run.cfg.seed, b)[b][3]
    if held.first != step - part:  # the batch's first step, or the first step of a resumed run
        mine = group[run.rank :: run.world]
        held.first, held.batch = step - part, _load(run, mine)
        held.anchors = [sample_anchors(lm, run.cfg.anchors, anchor_generator(run.cfg.seed, step - part, s))
                        for s, (_, _, lm, _) in zip(mine, held.batch)]  # fmt: skip
    return group, part, [a.tensor_split(n)[part] for a in held.anchors]


def _validate(run: _BlockRun, log: MetricsLog, step: int, again: bool = False) -> dict:
    """Every held-out sample (each rank its share), every valid anchor up to --anchors: recorded (unless
    `again`: its record is already there), returned."""
    st = BlockStats(run.draft.cfg.block_size)
    mine = run.data.val_sids[run.rank :: run.world]
    rounds = -(-len(run.data.val_sids) // run.world)  # as many calls on every rank (past its share: none)
    for i in range(rounds):
        st.add(run.model(_load(run, mine[i : i + 1]), None, CHUNK, run.cfg.anchors)[1])
    if run.sharded:
        run.model.reshard()
    val = _global(run, st).summary()
    if not again:
        log({"split": "val", "step": step, **val})
    return val


def _check_loss(run: _BlockRun, loss: torch.Tensor, step: int, last_good: str) -> None:
    """Raise NonFiniteError when the loss of optimizer step `step` + 1 is not finite on any rank (all ranks
    agree), before its update: the weights and the last checkpoint stay as they were."""
    from specdraft.train.checkpoint import NonFiniteError

    if _all_sum(
        torch.tensor([0.0 if torch.isfinite(loss.detach()).item() else 1.0], device=run.device)
    ).item():
        raise NonFiniteError(f"non-finite loss at step {step + 1}; nothing of this step was applied, last good "
                             f"checkpoint: {last_good}. Check the samples' hidden states (specdraft verify) or lower "
                             f"--lr (now {run.cfg.lr:g})")  # fmt: skip


def _checkpoint(run: _BlockRun, step: int) -> Path:
    """checkpoints/step_N (the draft, the optimizer, the step and the settings trained with), written whole,
    the oldest complete ones beyond --keep-checkpoints removed (`setup.write_checkpoint`)."""
    path = run.out / "checkpoints" / f"step_{step}"
    draft, opt_state = full_states(run.model, run.opt, run.sharded)  # all ranks: a collective under --fsdp
    if run.rank == 0:
        write_checkpoint(
            run.out,
            step,
            draft,
            opt_state,
            {"settings": asdict(run.cfg), "trained_loss": run.cfg.loss},
            run.cfg.keep_checkpoints,
        )
    barrier(run.world)
    return path


def _write_settings(run: _BlockRun, shards: str) -> None:
    """OUT/train_settings.json: the settings trained with (the recipe's where it applied; a valid --config
    FILE, what --resume reads back), as EAGLE-3's run writes it."""
    from specdraft.runtime import write_settings
    from specdraft.train.config import SETTINGS_FILE, run_settings

    if run.rank == 0:
        write_settings(run.out / SETTINGS_FILE, "train", run_settings(shards, run.out, run.cfg))


def _print_header(run: _BlockRun) -> None:
    dc = run.draft.cfg
    n = sum(p.numel() for p in run.params) / 1e6
    src = f", from {run.init_from}" if run.init_from else ""
    print(f"train: DFlash draft, {len(dc.aux_layer_ids)} target layers {dc.aux_layer_ids}, block {dc.block_size}, "
          f"{dc.num_hidden_layers} layer(s), {n:.2f}M trained params{src}, {len(run.data.train_sids)} train / "
          f"{len(run.data.val_sids)} val samples, {run.total} steps ({run.cfg.steps_per_batch} a batch), "
          f"{run.world} rank(s){', FSDP2' if run.sharded else ''}", flush=True)  # fmt: skip


@leaving_process_group()
def train_dflash(shards: str, out: str | Path, cfg, _stop_at: int | None = None) -> Path:
    """Train a DFlash draft on extracted shards; returns OUT/final. `_stop_at` ends the run after that step
    without writing final/ (tests: an interrupted run to resume)."""
    cfg = with_own_loss(cfg)  # --loss "": DFlash's own, ce (recorded as such)
    # --- check: the settings --draft dflash takes (the --init-from draft is checked against the data in setup)
    problems = block_problems(cfg) + _out_problems(Path(out), cfg.resume)
    if problems:
        raise ValueError("train: " + "; ".join(problems))

    # --- setup: processes, data (shards, or --online the target capturing a dataset), the recipe, target,
    # draft (fresh, --init-from, or --resume's checkpoint), optimizer ---
    run = _build(shards, Path(out), cfg)
    _write_settings(run, shards)
    if run.rank == 0:  # checkpoints/ temporaries of a killed run (OUT's own: the directory lock removes them)
        from specdraft.fileio import remove_dead_leftovers

        remove_dead_leftovers(run.out / "checkpoints")
    try:
        return _loop(run, _stop_at)
    finally:  # an online capture's engine (vLLM: other processes) ends with the run, failed or not
        close = getattr(run.data.ss, "close", None)
        if close is not None:
            close()


def _loop(run: _BlockRun, _stop_at: int | None) -> Path:
    """The training loop of a built run: returns OUT/final (the checkpoint at `_stop_at` when a test stops it)."""
    cfg = run.cfg  # the settings trained with (the recipe's where it applies)

    # --- logging: metrics.jsonl and the --report-to trackers (rank 0 writes) ---
    log = MetricsLog(run.out, run.rank, run.resumed is not None, run.start, cfg.tensorboard, cfg.report_to,
                     asdict(cfg), cfg.project, cfg.run_name)  # fmt: skip
    if run.rank == 0:
        _print_header(run)
    if run.start == 0:
        _validate(run, log, 0)

    # --- the loop ---
    held = _Held()
    last_good = str(run.resumed) if run.resumed is not None else "none"
    for step in range(run.start, run.total):
        # data: this rank's share of the step's global batch (its samples rank, rank + world, ...), loaded
        # once for its --steps-per-batch steps, and this step's group of each sample's anchors
        group, part, anchors = _step_data(run, step, held)

        # forward: the summed block losses (one call: FSDP2 gathers once); the global batch's stats (their
        # loss weight divides every rank's loss)
        loss, st = run.model(held.batch, anchors, CHUNK)
        st = _global(run, st)

        # backward, gradients summed over ranks, clip, step at this step's learning rate
        for g in run.opt.param_groups:
            g["lr"] = cfg.lr * run.lr_at(step)
        _check_loss(run, loss, step, last_good)
        _backward_step(run, loss, st.weight)
        check_weights(run.params, step + 1, run.opt.param_groups[0]["lr"], last_good, run.device)

        # log: the global batch's loss, accuracy per block slot, tau
        if (step + 1) % cfg.log_every == 0 or step + 1 == run.total:
            e, i, m, _ = run.plan[step // cfg.steps_per_batch]  # epochs done: e + the share of epoch e done
            log({"split": "train", "step": step + 1, "epoch": round(e + (i + (part + 1) / cfg.steps_per_batch) / m, 4),
                 "lr": run.opt.param_groups[0]["lr"],
                 "tokens": part_share(sum(run.data.lengths[s] for s in group), part, cfg.steps_per_batch),
                 **st.summary()})  # fmt: skip

        # checkpoint (and stop here when a test interrupts the run)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 in (run.total, _stop_at):
            path = _checkpoint(run, step + 1)
            last_good = str(path)
            if step + 1 == _stop_at:
                log.close()
                return path

    # --- end: final validation, final/ (rank 0); a finished run resumed with a lower --max-steps ends where it
    # stood (its step, not the lower count: nothing was trained past it, and its validation is not recorded again)
    end = max(run.start, run.total)
    val = _validate(run, log, end, again=run.start >= run.total and log.has("val", end))
    draft, _ = full_states(run.model, run.opt, run.sharded)  # all ranks: a collective under --fsdp
    final = run.out / "final"
    if run.rank == 0:
        from specdraft.fileio import atomic_dir, read_state
        from specdraft.runtime import write_settings
        from specdraft.train.checkpoint import disk_errors_named
        from specdraft.train.config import SETTINGS_FILE

        acc = " ".join("-" if a is None else f"{a:.2f}" for a in val["acc"])
        print(f"train: validation: tau {val['tau']:.2f}, accuracy per block slot {acc}")
        extra = {"step": end, "val": val, **({"init_from": run.init_from} if run.init_from else {})}
        settings = read_state(run.out / SETTINGS_FILE, "rerun the train command with --resume")["settings"]
        with disk_errors_named(final), atomic_dir(final, block_setup._window) as tmp:  # visible only whole
            write_dflash(draft, tmp, extra={"train": {**extra, "settings": settings}})
            write_settings(tmp / SETTINGS_FILE, "train", settings)
    log.close()
    barrier(run.world)
    return final
