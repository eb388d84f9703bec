"""train: the training loop of the EAGLE-3 draft, written out phase by phase in `train`.

`train` reads top to bottom: check the settings, set up (processes, data, draft, teacher, optimizer,
schedule), resume, then per optimizer step: data, forward (the TTT unroll of `ttt.py`), non-finite
check, backward, clip, step, log, validate, checkpoint; at the end a final validation, checkpoint and
the trained draft in OUT/final. Each phase is a function below taking the run's state (`_Run`).

Distributed runs (`torchrun`) use DDP (or FSDP2 `fully_shard` with `--fsdp`); every rank loads only its
rows of each global batch (online through vLLM, rank 0's engine captures them all: `batches.py::ScatteredSource`); rank 0
writes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.fileio import DirLock
from specdraft.model.checkpoint import EMBED_KEY, latest_checkpoint, load_draft, save_draft
from specdraft.runtime import resolve_device, resolve_dtype, write_settings
from specdraft.train.ahead import Ahead
from specdraft.train.batches import (
    Batch,
    _plan_hash,
    _to_device,
    load_rows,
    loss_part,
    part_share,
    plan_batches,
)
from specdraft.train.checkpoint import (
    NonFiniteError,
    _draft_from_state,
    _full_states,
    _load_train_state,
    _restore,
    _save_checkpoint,
    check_weights,
    disk_errors_named,
    foreign_problem,
    in_the_way,
    written_checkpoints,
)
from specdraft.train.config import _DEFAULTS, SETTINGS_FILE, TrainConfig, run_settings, with_own_loss
from specdraft.train.distributed import (
    _all_min,
    _all_sum,
    _init_distributed,
    barrier,
    leaving_process_group,
    wrap_model,
)
from specdraft.train.losses import parse_loss
from specdraft.train.optim import make_optimizer
from specdraft.train.report.metrics import MetricsLog
from specdraft.train.report.plot import plot_metrics
from specdraft.train.setup import _lr_lambda, _Setup, _setup, warm_problems
from specdraft.train.ttt import (
    TeacherHead,
    TopCache,
    TTTModel,
    head_checkpointing,
    keep_mask,
    step_token_counts,
    teacher_positions,
)

#: training.png is redrawn with a mid-run validation or checkpoint at most this often (a draw costs ~0.5 s)
PLOT_EVERY_S = 60.0


def _after_step(step: int) -> None:
    """Called after every optimizer step (a seam for tests that simulate a killed run)."""


# ---------------------------------------------------------------------------------------------------------
# the run's state
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What setup builds once and every phase reads: settings, processes, data plan, model, optimizer."""

    cfg: TrainConfig
    out_dir: Path
    rank: int
    world: int
    device: torch.device
    amp_dtype: str  # float32 or bfloat16 (autocast)
    amp: functools.partial  # amp() -> the autocast context of forward passes
    st: _Setup  # data source, sample ids, draft, teacher, provenance
    batches0: list[list[int]]  # the epoch-0 plan (its hash guards --resume)
    per_epoch: int  # optimizer steps per epoch
    total: int  # optimizer steps of the run
    val_batches: list[list[int]]
    model: TTTModel  # the draft unrolled K steps
    wrapped: nn.Module  # what forward is called on: the model, or DDP around it
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    info: dict  # settings, ranks, plan hash, provenance: recorded in every checkpoint's train_state.pt
    ema: list[torch.Tensor] = field(default_factory=list)  # --ema: the average of `params` (`_ema_update`)
    # the teacher's argmax of each sample, kept from its first batch (shards only: online states are captured
    # anew each epoch); None: computed every time
    tops: TopCache | None = None

    @property
    def sharded(self) -> bool:
        """FSDP2 over several ranks: full states must be gathered before rank 0 writes."""
        return self.cfg.fsdp and self.world > 1


@dataclass
class _Cursor:
    """Where the loop stands: optimizer steps done, the epoch, the step in it, that epoch's plan."""

    step: int
    epoch: int
    idx: int  # the step in the epoch: batch idx // --steps-per-batch, share idx % --steps-per-batch
    plan: list[list[int]]


@dataclass
class _Meter:
    """Time and tokens since the last train record (tokens/s, the share of step time spent on data)."""

    t_log: float = field(default_factory=time.time)
    tokens: int = 0
    padded: int = 0  # tokens including the padding of each rank's batch
    data_time: float = 0.0
    step_time: float = 0.0
    loader_busy: float = 0.0  # seconds the background loader spent loading (capturing, online)

    def count(self, batch_n: torch.Tensor, part: int, parts: int) -> int:
        """Count one step's tokens: share `part` of `parts` of its batch's global (data, padded) tokens
        `batch_n` (2,); the --steps-per-batch steps of a batch count shares adding up to all of them."""
        tokens = part_share(int(batch_n[0]), part, parts)
        self.tokens += tokens
        self.padded += part_share(int(batch_n[1]), part, parts)
        return tokens


# ---------------------------------------------------------------------------------------------------------
# setup and resume
# ---------------------------------------------------------------------------------------------------------


def _check(shards: str, out_dir: Path, cfg: TrainConfig) -> Path | None:
    """Every user error at once (before anything is built); returns the checkpoint to resume from."""
    errors = cfg.problems() + warm_problems(shards, cfg) + shards_problems(shards, cfg)
    errors += ttt_problems(shards, cfg) if not errors else []
    errors += foreign_problem(out_dir) + in_the_way(out_dir)
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None and not cfg.resume:
        errors.append(f"{out_dir} already holds checkpoints (newest {ckpt.name}): pass --resume to continue, "
                      "or choose another OUT directory")  # fmt: skip
    if cfg.resume and ckpt is None:
        errors.append(f"--resume: no checkpoint under {out_dir}/checkpoints to resume from")
    if errors:
        raise ValueError("train: " + "; ".join(errors))
    return ckpt


def shards_problems(shards: str, cfg: TrainConfig) -> list[str]:
    """Offline, the extraction directories: there, with readable manifests of one extraction (metadata only)."""
    from specdraft.data.store import manifest_problems

    if cfg.online:
        return []
    if not any(Path(p).is_dir() for p in shards.split(",") if p):
        return [f"{shards} is not a directory: pass an extraction directory (or --online with a dataset)"]
    return manifest_problems([p for p in shards.split(",") if p])


def ttt_problems(shards: str, cfg: TrainConfig) -> list[str]:
    """--ttt-steps against the data's longest sample (metadata only, before anything loads): TTT step k of a
    position t scores token t + k + 2, so a sample of n tokens unrolls at most n - 2 steps; more train nothing
    and each costs a forward of the draft."""
    n = longest_sample(shards, cfg)
    if n and cfg.ttt_steps > n - 2:
        return [f"--ttt-steps {cfg.ttt_steps} is longer than any sample can unroll: the longest sample has {n} tokens "
                f"(--max-length {cfg.max_length}), which unroll at most {n - 2}: lower --ttt-steps to at most {n - 2}"]  # fmt: skip
    return []


def longest_sample(shards: str, cfg: TrainConfig) -> int:
    """The longest sample of the data (the extraction's sidecars; online, the dataset), at most --max-length;
    0 when it cannot be read (opening the data says why)."""
    try:
        if cfg.online:
            from specdraft.data.prepare import load_dataset

            n = max((len(ids) for ids in load_dataset(shards).input_ids), default=0)
        else:
            sides = [p for d in shards.split(",") if d for p in Path(d).glob("shard-*-*.json")]
            n = max((max(json.loads(p.read_text())["lengths"], default=0) for p in sides), default=0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return min(n, cfg.max_length)


def _plan(st: _Setup, cfg: TrainConfig, world: int) -> tuple[list[list[int]], int, int, list[list[int]]]:
    """(epoch-0 plan, steps per epoch, total steps, validation batches); user errors when no batch fits."""
    if cfg.max_tokens < cfg.max_length * world and world > 1:
        longest = max(st.lengths.values())
        if longest * world > cfg.max_tokens:
            raise ValueError(f"train: --max-tokens {cfg.max_tokens} cannot hold {world} samples of up to {longest} "
                             f"tokens (one per rank): raise --max-tokens or lower --max-length")  # fmt: skip
    batches0 = plan_batches(st.train_sids, st.lengths, cfg.max_tokens, world, cfg.seed)
    per_epoch = len(batches0) * cfg.steps_per_batch  # optimizer steps: --steps-per-batch per batch
    if per_epoch == 0:
        raise ValueError(f"train: no training batch: {len(st.train_sids)} training samples of length >= 3 "
                         f"for {world} ranks; add data or lower --val-fraction")  # fmt: skip
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    # every held-out sample is validated: a batch with fewer samples than ranks is kept (`load_rows` gives a
    # rank without a row a zero-weight stand-in), so one val sample on 2 ranks is still validated
    val_batches = plan_batches(st.val_sids, st.lengths, cfg.max_tokens, world, None, keep_short=True)
    return batches0, per_epoch, total, val_batches


def _build(shards: str, out_dir: Path, cfg: TrainConfig) -> _Run:
    """Processes, data, draft, teacher, the TTT model (wrapped for DDP/FSDP), optimizer, schedule."""
    rank, world, device = _init_distributed(resolve_device(cfg.device, "train"))
    torch.manual_seed(cfg.seed)
    amp_dtype = resolve_dtype(cfg.dtype, str(device))
    amp = functools.partial(
        torch.autocast, device.type, dtype=torch.bfloat16, enabled=amp_dtype == "bfloat16"
    )
    st = _setup(shards, cfg, device)
    cfg = st.cfg  # with the small-run recipe's settings where it applies
    batches0, per_epoch, total, val_batches = _plan(st, cfg, world)
    ck_head = head_checkpointing(cfg.checkpoint_head, cfg.ttt_steps, cfg.max_tokens // world,
                                 st.draft.cfg.draft_vocab_size)  # fmt: skip
    model = TTTModel(st.draft, cfg.ttt_steps, cfg.decay, ck_head, cfg.attention_chunk, cfg.checkpoint_layer,
                     hard_weight=cfg.hard_weight, loss_terms=parse_loss(cfg.loss), noise=cfg.noise,
                     noise_scale=cfg.noise_scale)  # fmt: skip
    wrapped = wrap_model(model, world, cfg.fsdp, device)
    named = [(n, p) for n, p in model.draft.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if rank == 0:
        _check_disk(out_dir, sum(p.numel() for p in params), cfg.keep_checkpoints, 4 if cfg.ema else 3,
                    *_frozen_bytes(st.draft, st.embed_source is not None))  # fmt: skip
    optimizer = make_optimizer(named, cfg.optimizer, cfg.lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, total))
    info = {
        "config": asdict(cfg),
        "world": world,
        "plan_hash": _plan_hash(batches0),
        "provenance": st.provenance,
    }
    ema = [p.detach().clone() for p in params] if cfg.ema else []  # the init: its weight is 0 (`ema_decay`)
    return _Run(cfg, out_dir, rank, world, device, amp_dtype, amp, st, batches0, per_epoch, total,
                val_batches, model, wrapped, params, optimizer, scheduler, info, ema,
                None if cfg.online else TopCache())  # fmt: skip


_SAVE_OVERHEAD = 1 << 20  # bytes a save adds to its tensors, at most: headers, config.json, RNG states


def _frozen_bytes(draft: nn.Module, embed_referenced: bool) -> tuple[int, int]:
    """(bytes of the draft's state that training does not change, the part of it a checkpoint holds): the
    frozen embedding, d2t/t2d; final/ holds them all, checkpoints leave the embedding out when referenced."""
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    frozen = {k: t.numel() * t.element_size() for k, t in draft.state_dict().items() if k not in trainable}
    return sum(frozen.values()), sum(
        b for k, b in frozen.items() if not (embed_referenced and k == EMBED_KEY)
    )


def _check_disk(
    out_dir: Path, n_params: int, keep: int, copies: int = 3, frozen: int = 0, frozen_in_ckpt: int = 0
) -> None:
    """Refuse to start when what this run writes cannot fit: `keep` checkpoints (fp32 weights + AdamW's two
    moments, + the --ema average, + `frozen_in_ckpt`), one more while it is written, and final/ (the fp32
    weights and all `frozen` bytes: the embedding too). The checkpoints already in OUT (a resumed run's) are
    among those `keep` + 1: their bytes are not needed again."""
    import shutil

    per_ckpt = n_params * 4 * copies + frozen_in_ckpt + _SAVE_OVERHEAD
    final = n_params * 4 + frozen + _SAVE_OVERHEAD
    root = out_dir / "checkpoints"
    held = sum(f.stat().st_size for c in (written_checkpoints(root) if root.is_dir() else []) for f in c.rglob("*")
               if f.is_file())  # fmt: skip
    need = per_ckpt * (keep + 1) + final - min(held, per_ckpt * keep)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise OSError(f"train needs ~{need / 2**20:.0f} MiB in {out_dir}: {keep} checkpoint(s) of ~{per_ckpt / 2**20:.0f} "
                      f"MiB, one more while it is written, and {out_dir / 'final'} of ~{final / 2**20:.0f} MiB (the "
                      f"draft with its frozen embedding), but only {free / 2**20:.0f} MiB are free: free space, "
                      "choose another OUT directory, or lower --keep-checkpoints")  # fmt: skip


def _resume(run: _Run, ckpt: Path, state: dict | None = None) -> int:
    """Model, optimizer, scheduler and RNG from the checkpoint (same settings and data required); its step."""
    if state is None:
        state = _load_train_state(ckpt, run.cfg, run.world, _plan_hash(run.batches0), run.st.provenance)
    start = _restore(ckpt, state, run.model, run.optimizer, run.scheduler)
    with torch.no_grad():
        for e, saved in zip(run.ema, state["ema"] if run.ema else []):
            e.copy_(saved)
    if run.rank == 0:
        print(f"train: resuming from {ckpt} at step {start}/{run.total}", flush=True)
    return start


def _print_header(run: _Run) -> None:
    """One line: samples, steps, ranks, draft size, vocabulary, K, dtype and device."""
    st, cfg = run.st, run.cfg
    n_train_params = sum(p.numel() for p in run.params)
    print(f"train: {len(st.train_sids)} train / {len(st.val_sids)} val samples, {run.per_epoch} steps/epoch, "
          f"{run.total} steps, {run.world} rank(s), draft {n_train_params / 1e6:.2f}M trainable params, "
          f"Vd={st.draft.cfg.draft_vocab_size}, K={cfg.ttt_steps}, {run.amp_dtype} on {run.device}", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# one optimizer step: data, forward, checks, backward and step, the train record
# ---------------------------------------------------------------------------------------------------------


def _load(run: _Run, sids: list[int]) -> Batch:
    """This rank's rows of the global batch `sids` (runs in the prefetch thread when there is one)."""
    return load_rows(run.st.source, sids, run.rank, run.world, run.cfg.max_length, run.cfg.prompt_loss)


def _cursor_at(run: _Run, step: int) -> _Cursor:
    """The position of optimizer step `step` (0 for a fresh run, the checkpoint's step on --resume)."""
    epoch, idx = divmod(step, run.per_epoch)
    return _Cursor(step, epoch, idx, _epoch_plan(run, epoch))


def _epoch_plan(run: _Run, epoch: int) -> list[list[int]]:
    """The batches of one epoch: reshuffled per epoch from --seed (a pure function: resume redoes it)."""
    cfg = run.cfg
    return plan_batches(
        run.st.train_sids, run.st.lengths, cfg.max_tokens, run.world, cfg.seed * 100003 + epoch
    )


def _advance(run: _Run, cur: _Cursor) -> _Cursor:
    """The position after `cur`'s step: the next batch of the epoch, or the first of the next epoch's plan."""
    if cur.idx + 1 < run.per_epoch:
        return _Cursor(cur.step + 1, cur.epoch, cur.idx + 1, cur.plan)
    return _Cursor(cur.step + 1, cur.epoch + 1, 0, _epoch_plan(run, cur.epoch + 1))


@dataclass
class _Teacher:
    """The teacher of one batch and its per-TTT-step token counts (this rank's, or global after `_all_sum`)."""

    p: torch.Tensor  # (N, Vd) probabilities over the draft vocabulary at the N used positions, fp32
    negent: torch.Tensor  # (N,) sum over Vd of p log p (minus the entropy): the KL's constant term
    top: torch.Tensor  # (B, T) draft index of the full-vocabulary argmax, -1 outside the draft vocabulary
    row: torch.Tensor  # (B, T) the row of each position in p, -1 where the teacher is not needed
    kl_mask: torch.Tensor  # (B, T) the loss mask, less the out-of-vocabulary positions with --oov-mask
    counts: torch.Tensor  # (3, K): loss-masked tokens (accuracy), KL tokens, out-of-vocabulary tokens


def _teacher(teacher: TeacherHead, b: Batch, cfg: TrainConfig, amp, tops: TopCache | None = None,
             sids: list[int] | None = None) -> _Teacher:  # fmt: skip
    """Teacher probabilities and full-vocabulary argmax at the positions the loss reads (the next token is
    loss-masked; prompt and padding positions are skipped), the KL mask (EAGLE-3's `t2d[argmax]` with
    --oov-mask), counts. With `tops` (and the rows' sample ids `sids`) an argmax computed before is reused: only
    the draft-vocabulary logits are computed then (the same to the bit)."""
    K = cfg.ttt_steps
    need = teacher_positions(b.loss_mask)  # (B, T)
    tops = tops if sids is not None else None  # (no rows named: nothing to key the argmax by)
    known = tops.known(sids, need) if tops is not None else None  # (N,) or None
    with torch.no_grad(), amp():
        if known is not None:
            logits, top_n = teacher.draft_logits(b.final[need]), known  # (N, H) -> (N, Vd), (N,)
        else:
            logits, top_n = teacher(b.final[need])  # (N, H) -> (N, Vd), (N,)
            if tops is not None:
                tops.record(sids, need, top_n)
        logp = F.log_softmax(logits, dim=-1)  # (N, Vd) fp32
        p = logp.exp()  # (N, Vd)
        negent = (p * logp).sum(-1)  # (N,)
    row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)  # (B, T)
    row[need] = torch.arange(len(top_n), device=need.device)
    top = torch.full_like(row, -1)  # (B, T): -1 (out of vocabulary) where unused: its loss mask is 0
    top[need] = top_n
    in_vocab = keep_mask(b.loss_mask, top, True)  # (B, T) loss positions whose target argmax is in Vd
    kl_mask = keep_mask(b.loss_mask, top, cfg.oov_mask)  # (B, T)
    n_loss = step_token_counts(b.loss_mask, K)  # (K,)
    counts = torch.stack(
        [n_loss, step_token_counts(kl_mask, K), n_loss - step_token_counts(in_vocab, K)]
    )  # (3, K)
    return _Teacher(p, negent, top, row, kl_mask, counts.float())


def _forward(
    run: _Run, b: Batch, t: _Teacher, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K-step TTT unroll: this rank's loss, KL sums (K,), agreement sums (K,); counts (3, K) global."""
    with run.amp():
        return run.wrapped(b.input_ids, b.aux, t.p, t.negent, t.top, t.row, b.loss_mask, t.kl_mask,
                           counts[1].clamp(min=1) / run.world)  # fmt: skip


def _where(cur: _Cursor, sids: list[int]) -> str:
    """The step, batch and samples of a non-finite error message."""
    return f"step {cur.step + 1} (epoch {cur.epoch}, step {cur.idx} of the epoch, samples {sids})"


def _check_loss(run: _Run, loss: torch.Tensor, cur: _Cursor, sids: list[int], last_ckpt: str) -> None:
    """Raise NonFiniteError when the loss is not finite on any rank (all ranks agree; nothing changed yet)."""
    ok = _all_min(torch.tensor(float(torch.isfinite(loss).item()), device=run.device))
    if ok.item() < 1:
        raise NonFiniteError(f"non-finite loss at {_where(cur, sids)}; nothing of this step was applied, "
                             f"last good checkpoint: {last_ckpt}. Check those samples' hidden states "
                             f"(specdraft verify) or lower --lr (now {run.cfg.lr:g})")  # fmt: skip


def _backward_step(run: _Run, loss: torch.Tensor, cur: _Cursor, sids: list[int], last_ckpt: str) -> float:
    """Backward, clip, check the gradient norm (NonFiniteError before any update), optimizer step."""
    cfg = run.cfg
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    if not math.isfinite(gnorm):
        raise NonFiniteError(f"non-finite gradient at {_where(cur, sids)}; the update was not applied, "
                             f"last good checkpoint: {last_ckpt}. Lower --lr or check those samples")  # fmt: skip
    lr = run.scheduler.get_last_lr()[0]  # this update's
    run.optimizer.step()
    check_weights(run.params, cur.step + 1, lr, last_ckpt, run.device)  # before any checkpoint holds them
    run.scheduler.step()
    _ema_update(run, cur.step + 1)
    return gnorm


def ema_decay(ema: float, t: int) -> float:
    """--ema's decay at update t (t = 1 after the first optimizer step): 1 - (1 - ema) / (1 - ema**t).

    Adam's bias correction, applied at each update: the plain average e_t = ema e + (1 - ema) w_t started
    from 0 has weights summing to 1 - ema**t; the average kept is e_t / (1 - ema**t), which is this lerp
    with decay 0 at t = 1 (the init gets no weight) tending to `ema`. So after t steps it is the weights
    w_1..w_t weighted by ema**(t - s), normalised: a short run is its own steps, not mostly the random init
    (a fixed decay left 0.99**30 = 74% of the init after 30 steps), and a long run is what a fixed decay
    gave (after 462 steps at 0.99 the init's share was 1%).
    """
    assert t >= 1 and 0 < ema < 1
    return 1 - (1 - ema) / (1 - ema**t)


def _ema_update(run: _Run, t: int) -> None:
    """--ema: e = d e + (1 - d) p, d = `ema_decay` at update t = the optimizer steps done, this one included.
    t is the checkpoint's `step` (--resume restores it and the average): a resumed run goes on exactly."""
    if not run.ema:
        return
    d = ema_decay(run.cfg.ema, t)
    with torch.no_grad():
        for e, p in zip(run.ema, run.params):
            e.lerp_(p, 1 - d)


def _train_record(
    run: _Run, step: int, kl_s, agree_s, counts: torch.Tensor, gnorm: float, tokens: int, meter: _Meter
) -> dict:
    """The metrics record of `step`: global per-TTT-step KL, accuracy (against the full-vocabulary argmax)
    and out-of-vocabulary share, loss, lr, the step's data tokens (global; its share of the batch's with
    --steps-per-batch), tokens/s, data share, pad share (since the last record). counts (3, K) global."""
    kl_g, ag_g = _all_sum(kl_s.float()), _all_sum(agree_s.float())  # (K,) global sums
    dt = time.time() - meter.t_log
    return {"split": "train", "step": step, "epoch": round(step / run.per_epoch, 4),
            **_step_means(kl_g, ag_g, counts, run.cfg.decay), "lr": run.scheduler.get_last_lr()[0],
            "grad_norm": gnorm, "tokens": tokens,
            "tokens_per_s": meter.tokens / max(dt, 1e-9), "data_share": meter.data_time / max(meter.step_time, 1e-9),
            "pad_share": 1 - meter.tokens / max(meter.padded, 1),
            "loader_idle_share": max(0.0, 1 - meter.loader_busy / max(dt, 1e-9))}  # fmt: skip


def _step_means(kl: torch.Tensor, agree: torch.Tensor, counts: torch.Tensor, decay: float) -> dict:
    """loss, kl_i (per KL token), acc_i (per loss token, full-vocabulary argmax), oov_share_i; sums (K,), counts (3, K)."""
    n_loss, n_kl = counts[:2].float().cpu().clamp(min=1)  # (K,) each
    kl_mean = kl.float().cpu() / n_kl  # (K,)
    w = torch.tensor([decay**i for i in range(kl.shape[0])])  # (K,)
    return {"loss": float((w * kl_mean).sum()), "kl": kl_mean.tolist(), "acc": (agree.float().cpu() / n_loss).tolist(),
            "oov_share": (counts[2].float().cpu() / n_loss).tolist()}  # fmt: skip


def _postfix(rec: dict) -> str:
    """The progress bar's summary of a train record."""
    accs = "/".join(f"{a:.2f}" for a in rec["acc"][:4])
    return f"loss {rec['loss']:.3f} acc {accs} {rec['tokens_per_s']:.0f} tok/s"


# ---------------------------------------------------------------------------------------------------------
# validate, checkpoint, finish
# ---------------------------------------------------------------------------------------------------------


def _evaluate(
    model: TTTModel,
    teacher: TeacherHead,
    batches: list[list[int]],
    source,
    cfg: TrainConfig,
    device,
    amp,
    rank,
    world,
    tops: TopCache | None = None,
) -> dict:
    """Validation: global means of the loss, per-step accuracy and out-of-vocabulary share over the val batches."""
    K = cfg.ttt_steps
    kl, agree, cnt = torch.zeros(K), torch.zeros(K), torch.zeros(3, K)  # sums over this rank's rows
    with torch.no_grad():
        for sids in batches:
            b = _to_device(load_rows(source, sids, rank, world, cfg.max_length), device)
            t = _teacher(teacher, b, cfg, amp, tops, sids[rank::world])
            with amp():
                _, k_s, a_s = model(b.input_ids, b.aux, t.p, t.negent, t.top, t.row, b.loss_mask, t.kl_mask,
                                    torch.ones(K, device=device))  # fmt: skip
            kl += k_s.float().cpu()
            agree += a_s.float().cpu()
            cnt += t.counts.cpu()
    kl, agree, cnt = _all_sum(kl), _all_sum(agree), _all_sum(cnt)
    return {**_step_means(kl, agree, cnt, cfg.decay), "tokens": int(cnt[0, 0])}


def _validate(run: _Run, log: MetricsLog, step: int, again: bool = False) -> dict | None:
    """Evaluate the held-out batches, record (unless `again`: its record is already there) and print the
    result (None without validation data)."""
    if not run.val_batches:
        return None
    r = _evaluate(run.model, run.st.teacher, run.val_batches, run.st.source, run.cfg, run.device, run.amp,
                  run.rank, run.world, run.tops)  # fmt: skip
    if not again:
        log({"split": "val", "step": step, **r})
    if run.rank == 0:
        accs = " ".join(f"{a:.3f}" for a in r["acc"])
        print(f"train: step {step} val loss {r['loss']:.4f} acc/step [{accs}]", flush=True)
    return r


def _checkpoint(run: _Run, step: int) -> str:
    """Write checkpoint `step` (a collective: all ranks gather, rank 0 writes); its path on rank 0."""
    full_model, full_opt = _full_states(run.model, run.optimizer, run.sharded)
    path = ""
    if run.rank == 0:
        draft_cpu = _draft_from_state(run.st.draft, full_model) if run.sharded else run.st.draft
        info = {**run.info, "ema": [e.cpu() for e in run.ema]}
        path = str(_save_checkpoint(run.out_dir, step, draft_cpu, full_opt, run.scheduler, info,
                                    run.cfg.keep_checkpoints, run.st.embed_source))  # fmt: skip
    barrier(run.world)
    return path


def _finish(run: _Run, log: MetricsLog, step: int, val: dict | None) -> Path:
    """OUT/final (the trained draft, with its step count, last validation and provenance) and training.png."""
    final = run.out_dir / "final"
    if run.rank == 0:
        draft_cpu = run.st.draft if not run.sharded else load_draft(latest_checkpoint(run.out_dir))
        with disk_errors_named(final):
            settings = json.loads((run.out_dir / SETTINGS_FILE).read_text())["settings"]  # as it started
            save_draft(draft_cpu, final, extra={"train": {"steps": step, "val": val, "settings": settings,
                                                          **run.st.provenance}})  # fmt: skip
            write_settings(final / SETTINGS_FILE, "train", settings)
        plot_metrics(log.path, run.out_dir / "training.png")
        log.close()
        print(f"train: done, {step} steps -> {final}", flush=True)
    barrier(run.world)
    return final


# ---------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------


def train(shards: str, out: str, cfg: TrainConfig = _DEFAULTS) -> Path:
    """Train an EAGLE-3 draft with training-time test; returns OUT/final (the trained draft).

    Args:
        shards: extraction directory (several: comma-separated) from `specdraft extract`; with --online a
            prepared dataset directory from `specdraft prepare`.
        out: output directory: checkpoints/, final/, metrics.jsonl (rerun with --resume to continue).
    """
    out_dir = Path(out)
    refuse_early(shards, out_dir, cfg)  # before OUT or its lock exists: a refused run creates nothing
    # one training run per directory: rank 0 of a run holds the lock (a second run fails at once)
    lock = (
        DirLock(out_dir, "training run")
        if int(os.environ.get("RANK", "0")) == 0
        else contextlib.nullcontext()
    )
    with lock:
        refuse_other_run(out_dir, cfg.draft)  # before anything loads or is written
        if cfg.draft == "dflash":  # block-parallel draft: its own loop over the same data (train/block)
            from specdraft.train.block.run import train_dflash

            return train_dflash(shards, out_dir, cfg)
        return train_loop(shards, out_dir, cfg)


_KINDS = {"specdraft.eagle3": "eagle3", "specdraft.dflash": "dflash"}  # a saved draft's format -> its kind


def run_kind(out_dir: Path) -> tuple[str, str] | None:
    """(draft kind, what says so) of the training run OUT holds, from its settings file or final/'s format;
    None for an OUT that holds no run (or one whose files say nothing readable)."""
    import json

    for f, read in ((out_dir / SETTINGS_FILE, lambda d: (d.get("settings") or {}).get("draft", "eagle3")),
                    (out_dir / "final" / "config.json", lambda d: _KINDS.get(d.get("format")))):  # fmt: skip
        try:
            kind = read(json.loads(f.read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if kind:
            return kind, str(f)
    return None


def refuse_early(shards: str, out_dir: Path, cfg: TrainConfig) -> None:
    """Every refusal that reads only the settings, the data's metadata and OUT, before OUT or its lock exists
    (under the lock `train_loop` and `train_dflash` check again: another process may have written since)."""
    from specdraft.fileio import file_in_the_way

    blocked = file_in_the_way(out_dir, "training run")
    if blocked is not None:
        raise blocked
    refuse_other_run(out_dir, cfg.draft)
    cfg = with_own_loss(cfg)
    if cfg.draft != "dflash":
        _check(shards, out_dir, cfg)
        return
    from specdraft.train.block.run import _out_problems, block_problems

    errors = block_problems(cfg) + shards_problems(shards, cfg) + _out_problems(out_dir, cfg.resume)
    if errors:
        raise ValueError("train: " + "; ".join(errors))


def refuse_other_run(out_dir: Path, draft: str) -> None:
    """One identity per OUT: a train OUT belongs to one draft kind; a run of the other kind into it (which would
    replace its final/, cut its metrics and prune its checkpoints) is refused before anything loads."""
    held = run_kind(out_dir)
    if held and held[0] != draft:
        raise ValueError(f"train: {out_dir} holds a --draft {held[0]} run ({held[1]} says so); a --draft {draft} run "
                         "there would replace its draft and metrics: choose another OUT directory")  # fmt: skip


def resume_hint(argv: list[str], out: str) -> str:
    """What to run after `specdraft train` (`argv`, the command's own arguments) stopped: the same arguments
    with --resume, or without it when no checkpoint was written yet."""
    import shlex

    from specdraft.model.dflash_files import newest_checkpoint

    args = [a for a in argv if a not in ("--resume", "--no-resume")]
    if (
        latest_checkpoint(Path(out)) is None and newest_checkpoint(out) is None
    ):  # EAGLE-3's, or --draft dflash's
        return f"no checkpoint was written yet: rerun `specdraft {shlex.join(args)}` to start over"
    return f"resume with `specdraft {shlex.join([*args, '--resume'])}`"


@leaving_process_group()
def train_loop(shards: str, out_dir: Path, cfg: TrainConfig) -> Path:
    """The training loop of `train`, phase by phase."""
    cfg = with_own_loss(cfg)  # --loss "": EAGLE-3's own, kl (recorded as such)
    # --- check: every user error at once, before a process group, a target or a file exists -----------------
    ckpt = _check(shards, out_dir, cfg)

    # --- setup: processes, data, draft, teacher, optimizer, schedule ----------------------------------------
    run = _build(shards, out_dir, cfg)
    # a refused --resume (other settings, ranks or data) is refused here, before anything is written
    state = (
        _load_train_state(ckpt, run.cfg, run.world, _plan_hash(run.batches0), run.st.provenance)
        if cfg.resume
        else None
    )
    if run.rank == 0:  # the settings trained with (the recipe's where it applied): a valid --config FILE
        write_settings(out_dir / SETTINGS_FILE, "train", run_settings(shards, out_dir, run.cfg))
    try:
        return _train(run, ckpt, state)
    finally:  # an online source's engine (vLLM: other processes) ends with the run, failed or not
        getattr(run.st.source, "close", lambda: None)()


def _print_waits(ahead: Ahead, threaded: bool) -> None:
    """Online: the share of the run the trainer waited on the target, and (captured ahead) the reverse."""
    wall = max(time.time() - ahead.t_start, 1e-9)
    line = f"train: online: the trainer waited on the target {ahead.wait_total / wall:.0%} of the run"
    if threaded:
        line += f"; the target waited on the trainer {max(0.0, 1 - ahead.busy_total / wall):.0%}"
    print(line, flush=True)


def _upcoming(run: _Run, cur: _Cursor) -> Iterator[list[int]]:
    """The sample ids of each batch from `cur`'s on, in training order, until the last step."""
    n_parts = run.cfg.steps_per_batch
    while cur.step < run.total:
        yield cur.plan[cur.idx // n_parts]
        for _ in range(n_parts - cur.idx % n_parts):  # to the first step of the next batch
            cur = _advance(run, cur)


def _train(run: _Run, ckpt: Path | None, state: dict | None = None) -> Path:
    """Resume (from `ckpt` and its checked `state`), log, the loop and the end of a built run (`train_loop`)."""
    cfg, out_dir = run.cfg, run.out_dir
    # --- resume: model, optimizer, scheduler, RNG; the data position follows from the step ------------------
    start = _resume(run, ckpt, state) if cfg.resume else 0

    # --- logging: metrics jsonl (+ TensorBoard), progress bar (rank 0 only) ---------------------------------
    log = MetricsLog(out_dir, run.rank, cfg.resume, start, cfg.tensorboard, cfg.report_to, run.info["config"],
                     cfg.project, cfg.run_name)  # fmt: skip
    if run.rank == 0:
        _print_header(run)
    last_ckpt = str(ckpt) if cfg.resume else "none"
    if start == 0 and (cfg.val_every or cfg.val_fraction):
        _validate(run, log, 0)

    # --- the loop -------------------------------------------------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(total=run.total, initial=start, disable=run.rank != 0 or not cfg.progress, unit="step",
               dynamic_ncols=True)  # fmt: skip
    cur = _cursor_at(run, start)
    n_parts = cfg.steps_per_batch
    # batches loaded (shards) or captured (online through vLLM) ahead by a background thread, in plan order
    threaded = cfg.prefetch and (not cfg.online or cfg.backend == "vllm")
    ahead = Ahead(lambda sids: _load(run, sids), _upcoming(run, cur), cfg.prefetch_depth if threaded else 0)
    meter = _Meter()
    last_plot = time.time()  # training.png: first drawn PLOT_EVERY_S into the loop, then at most that often
    whole, batch_n = None, torch.zeros(2, dtype=torch.long)
    run.model.train()
    try:
        while cur.step < run.total:
            t0 = time.time()
            # data: this step's rows (prepared ahead); with --steps-per-batch N a batch serves N steps, step j
            # scoring the j-th share of its loss mask
            sids, part = cur.plan[cur.idx // n_parts], cur.idx % n_parts
            if whole is None or part == 0:
                whole = _to_device(ahead.take(), run.device)
                # (2,) the batch's global data and padded tokens; the meter counts this step's share of them
                batch_n = _all_sum(torch.tensor([whole.tokens, whole.input_ids.numel()]))  # int64: exact
            tokens = meter.count(batch_n, part, n_parts)  # the tokens this step trains on
            nxt = _advance(run, cur)
            b = whole if n_parts == 1 else replace(whole, loss_mask=loss_part(whole.loss_mask, part, n_parts))
            t_data = time.time() - t0

            # teacher: draft-vocabulary log-probs, full-vocabulary argmax, (3, K) global token counts per
            # TTT step (loss-masked, kept for the KL, out of the draft vocabulary)
            t = _teacher(run.st.teacher, b, cfg, run.amp, run.tops, sids[run.rank :: run.world])
            counts = _all_sum(t.counts)

            # forward: the K-step TTT unroll
            loss, kl_s, agree_s = _forward(run, b, t, counts)

            # non-finite check before anything changes (all ranks agree, the last checkpoint stays intact)
            _check_loss(run, loss, cur, sids, last_ckpt)

            # backward, clip, check the gradient, step
            gnorm = _backward_step(run, loss, cur, sids, last_ckpt)
            cur = nxt
            meter.step_time += time.time() - t0
            meter.data_time += t_data

            # log: global per-step KL and accuracy, tokens/s, the trainer's and the loader's wait shares
            if cur.step % cfg.log_every == 0 or cur.step == run.total:
                meter.loader_busy = ahead.busy_seconds()
                rec = _train_record(run, cur.step, kl_s, agree_s, counts, gnorm, tokens, meter)
                log(rec)
                bar.set_postfix_str(_postfix(rec))
                meter = _Meter()
            bar.update(1)

            # validate and checkpoint; training.png redrawn with them
            validate = cfg.val_every and cur.step % cfg.val_every == 0 and cur.step < run.total
            if validate:
                _validate(run, log, cur.step)
            checkpoint = cur.step % cfg.checkpoint_every == 0 and cur.step < run.total
            if checkpoint:
                last_ckpt = _checkpoint(run, cur.step)
            if (validate or checkpoint) and run.rank == 0 and time.time() - last_plot >= PLOT_EVERY_S:
                plot_metrics(log.path, run.out_dir / "training.png")
                last_plot = time.time()
            _after_step(cur.step)
    finally:
        bar.close()
        ahead.close()
    if run.rank == 0 and cfg.online:
        _print_waits(ahead, threaded)

    # --- end: final checkpoint (the weights trained, and --ema's average), final validation, the trained draft --
    _checkpoint(run, cur.step)
    with torch.no_grad():
        for p, e in zip(run.params, run.ema):  # --ema: final/ and its validation hold the moving average
            p.copy_(e)
    # a run killed after this validation, before final/, resumes at its last step: its record is not written twice
    val = _validate(run, log, cur.step, again=start >= run.total and log.has("val", cur.step))
    return _finish(run, log, cur.step, val)
