"""train: the EAGLE-3 draft trained with training-time test (TTT) on stored or live target hidden states.

Alignment (one sample of T tokens x_0 .. x_{T-1}; target features f_t = cat(aux_1, aux_2, aux_3) at
position t, (T, 3H); the target's final hidden state z_t (id L, before the norm), (T, H)):

    TTT step i = 0 .. K-1, draft slot t:
        input token      x_{t+1+i}                 ids shifted by 1 + i          (B, T)
        input hidden     fc(f_t)          (i = 0)  fused target features        (B, T, H)
                         hidden_out_{i-1}[t] (i>0)  the draft's own previous output (pre-final-norm)
        position         t + i                                                  (B, T)
        predicts         x_{t+2+i}
        teacher          softmax over the draft vocabulary of lm_head(norm(z_{t+1+i}))[t2d]    (B, T, Vd)
        loss mask        loss_mask[t+2+i] (0 where t+2+i >= T)                 (B, T)
        attention keys   step-0 keys at slots 0..t (causal prefix over target-feature keys) and, for
                         each earlier step j in 1..i, only step j's key at slot t (the same position)

    This is exactly what speculative decoding runs: after a target forward over x_0..x_{p+1}, the draft's
    first step sees features of 0..p with tokens x_1..x_{p+1} (cache of step-0 keys), and its j-th next
    step feeds its own hidden state at position p+j, attending to that cache plus its own earlier keys.

    loss = sum_i decay**i * KL(teacher_i || draft_i), each averaged over the loss-masked tokens of the
    whole global batch (all ranks); acc_i = share of those tokens where argmax draft == argmax teacher.

The loop in `train` is written out phase by phase: data, forward (TTT unroll), non-finite check,
backward, clip, step, log, validate, checkpoint. Distributed runs (`torchrun`) use DDP (or FSDP2
`fully_shard` with `--fsdp`); every rank loads only its rows of each global batch; rank 0 writes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from specdraft.data.batching import token_batches
from specdraft.model.checkpoint import LATEST_FILE, STATE_FILE, latest_checkpoint, load_draft, save_draft
from specdraft.model.draft import DraftKVCache, Eagle3Draft, build_draft

METRICS_FILE = "metrics.jsonl"


class NonFiniteError(ValueError):
    """Training met a non-finite loss or gradient; the message names the step, batch and last good checkpoint."""


def _after_step(step: int) -> None:
    """Called after every optimizer step (a seam for tests that simulate a killed run)."""


# ---------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Settings of `specdraft train`; the library defaults are EAGLE-3's."""

    target: str = ""  # target model (dir, hub id, smollm2-135m); default: the shards' manifest's
    online: bool = False  # capture hidden states from the target in process (DATA is then a prepared dataset)
    layers: list[int] | None = None  # aux layer ids for --online (default 2, L//2, L-3)
    draft_vocab_size: int = 32000  # draft vocabulary size (top tokens by frequency), capped at the target's
    norm_before_residual: bool = False  # residual = hidden_norm(h) (speculators variant) instead of h
    init_lm_head: bool = True  # start lm_head from the target's rows of the draft vocabulary
    ttt_steps: int = 7  # training-time-test unroll depth K (EAGLE-3: 7; speculators: 3)
    decay: float = 0.8  # weight of TTT step i is decay**i
    epochs: int = 1  # passes over the training split
    max_steps: int = 0  # stop after this many optimizer steps (0 = run all epochs)
    max_tokens: int = 4096  # padded tokens per optimizer step, summed over all ranks (length-grouped batches)
    max_length: int = 2048  # longer samples are truncated to this many tokens
    max_samples: int = 0  # use only the first N samples (0 = all)
    lr: float = 1e-4  # peak learning rate of AdamW
    min_lr_ratio: float = 0.0  # final learning rate as a fraction of the peak
    schedule: str = "cosine"  # decay after warmup: cosine, linear or constant
    warmup_ratio: float = 0.015  # warmup length as a fraction of all steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 0.5  # clip the global gradient norm to this (0 = off)
    val_fraction: float = 0.02  # share of samples held out for validation (at least 1 when > 0)
    val_every: int = 0  # validate every N steps (0 = only before and after training)
    log_every: int = 1  # write a metrics record every N steps
    checkpoint_every: int = 500  # write a resumable checkpoint every N steps (and always at the end)
    keep_checkpoints: int = 2  # how many step checkpoints to keep (the newest)
    resume: bool = False  # continue exactly from the newest checkpoint in OUT
    seed: int = 0  # seed of the draft's init and of the data order
    device: str = "cpu"  # cpu, cuda (under torchrun: cuda:LOCAL_RANK)
    dtype: str = ""  # compute dtype: float32 or bfloat16 (autocast); default float32 on CPU, bfloat16 on CUDA
    fsdp: bool = False  # shard the draft with FSDP2 fully_shard instead of DDP (distributed runs)
    checkpoint_head: bool = True  # recompute lm_head + loss in backward (saves K x tokens x Vd activations)
    prefetch: bool = True  # load the next batch from the shards in a background thread
    tensorboard: bool = True  # also log to OUT/tb when the tensorboard package is installed
    progress: bool = True  # show a progress bar

    def problems(self) -> list[str]:
        """Every user error in these settings (empty when all is well)."""
        errs = []
        for name in ("ttt_steps", "epochs", "max_tokens", "max_length", "draft_vocab_size", "log_every",
                     "checkpoint_every", "keep_checkpoints"):  # fmt: skip
            if getattr(self, name) < 1:
                errs.append(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        for name in ("max_steps", "max_samples", "val_every", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                errs.append(f"--{name.replace('_', '-')} must not be negative, not {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            errs.append(f"--decay must be in (0, 1], not {self.decay}")
        if self.lr <= 0:
            errs.append(f"--lr must be positive, not {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup_ratio < 1:
            errs.append("--min-lr-ratio must be in [0, 1] and --warmup-ratio in [0, 1)")
        if not 0 <= self.val_fraction < 1:
            errs.append(f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        if self.schedule not in ("cosine", "linear", "constant"):
            errs.append(f"--schedule must be cosine, linear or constant, not {self.schedule!r}")
        if self.dtype not in ("", "float32", "bfloat16"):
            errs.append(f"--dtype must be float32 or bfloat16, not {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            errs.append(f"--device must be cpu or cuda[:N], not {self.device!r}")
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            errs.append(f"--device {self.device}: CUDA is not available here; use --device cpu")
        if self.layers is not None and not self.online:
            errs.append("--layers applies to --online only (offline, the shards' layer ids are used)")
        if self.max_length < 3:
            errs.append("--max-length must be at least 3 (a draft position needs tokens t, t+1, t+2)")
        return errs


_DEFAULTS = TrainConfig()
# settings that may change on --resume without breaking exactness
_RESUME_FREE = {"resume", "progress", "tensorboard", "checkpoint_every", "keep_checkpoints", "log_every",
                "val_every", "prefetch", "device", "max_steps", "target"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# teacher and the training-time-test loss
# ---------------------------------------------------------------------------------------------------------


class TeacherHead(nn.Module):
    """The target's frozen final norm + lm_head rows of the draft vocabulary: z (.., H) -> logits (.., Vd).

    Equal to `target.logits_from_final(z)[..., t2d]` but never materialises the full vocabulary.
    """

    def __init__(self, target, t2d: torch.Tensor):
        super().__init__()
        self.norm = copy.deepcopy(target.norm).requires_grad_(False)
        head = target.lm_head
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"the target's lm_head is a {type(head).__name__}, not a Linear: not supported yet"
            )
        keep = t2d.to(head.weight.device)
        self.register_buffer("weight", head.weight.detach()[keep].clone())  # (Vd, H)
        self.register_buffer("bias", None if head.bias is None else head.bias.detach()[keep].clone())
        self.softcap = target.logit_softcap

    @torch.no_grad()
    def forward(self, final: torch.Tensor) -> torch.Tensor:
        z = self.norm(final.to(self.weight.dtype))  # (B, T, H)
        logits = F.linear(z, self.weight, self.bias).float()  # (B, T, Vd)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def ttt_mask(T: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Attention mask of TTT step `step` over [step-0 keys | step-1 keys | ... | step-`step` keys].

    Returns bool (1, 1, T, (step + 1) * T), True = attend: a causal block over the step-0 keys (target
    features), then one diagonal block (same slot only) for each later step.
    """
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
    eye = torch.eye(T, dtype=torch.bool, device=device)  # (T, T)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]  # (1, 1, T, (step+1) T)


def _head_stats(
    draft: Eagle3Draft,
    h: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_top: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked sums of KL(teacher || draft) and of top-1 agreement for hidden_out h (B, n, H)."""
    logq = F.log_softmax(draft.compute_logits(h).float(), dim=-1)  # (B, n, Vd)
    kl = (teacher_logp.exp() * (teacher_logp - logq)).sum(-1)  # (B, n)
    agree = (logq.argmax(-1) == teacher_top).float()  # (B, n)
    return (kl * mask).sum(), (agree * mask).sum().detach()


def ttt_unroll(draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int):
    """Yield the draft's hidden_out (B, T, H) of TTT steps 0 .. K-1 (alignment in the module docstring).

    Step i: tokens shifted by 1 + i, positions + i, input hidden = step i-1's output (fused features for
    step 0), keys = [step-0 keys | step-1 keys | ... | step-i keys] under `ttt_mask(T, i)`.
    """
    B, T = input_ids.shape
    ids = F.pad(input_ids, (0, ttt_steps + 1))  # (B, T + K + 1)
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    h = draft.fuse(aux)  # (B, T, H)
    cache = DraftKVCache()
    for i in range(ttt_steps):
        ids_i = ids[:, 1 + i : 1 + i + T]  # (B, T): token x_{t+1+i} at slot t
        mask_i = None if i == 0 else ttt_mask(T, i, input_ids.device)  # (1, 1, T, (i+1) T); step 0: causal
        h, _ = draft(ids_i, h, pos + i, mask_i, cache, compute_logits=False)  # (B, T, H)
        yield h


class TTTModel(nn.Module):
    """The draft unrolled K steps (training-time test); what DDP/FSDP wraps (one forward per optimizer step)."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int, decay: float, checkpoint_head: bool = True):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.decay = decay
        self.checkpoint_head = checkpoint_head

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        teacher_logp: torch.Tensor,
        loss_mask: torch.Tensor,
        norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One global-batch share.

        Args:
            input_ids: (B, T) token ids, right-padded.
            aux: (B, T, 3H) target aux features.
            teacher_logp: (B, T, Vd) log-softmax of the teacher at every position (position t predicts t+1).
            loss_mask: (B, T) float, 0 on padding.
            norm: (K,) the per-step divisor of the KL sums (global masked-token counts / world size).

        Returns:
            loss (scalar), kl_sums (K,) and agree_sums (K,) of this rank, both detached.
        """
        T = input_ids.shape[1]
        K = self.ttt_steps
        lmask = F.pad(loss_mask, (0, K + 2))  # (B, T + K + 2)
        teacher_top = teacher_logp.argmax(-1)  # (B, T)
        loss = aux.new_zeros((), dtype=torch.float32)
        kl_sums, agree_sums = [], []
        for i, h in enumerate(ttt_unroll(self.draft, input_ids, aux, K)):  # h: (B, T, H) of step i
            n = T - 1 - i  # slots whose teacher position t+1+i exists
            if n <= 0:
                kl_sums.append(loss.new_zeros(()))
                agree_sums.append(loss.new_zeros(()))
                continue
            args = (h[:, :n], teacher_logp[:, 1 + i : 1 + i + n], teacher_top[:, 1 + i : 1 + i + n],
                    lmask[:, 2 + i : 2 + i + n])  # (B, n, H), (B, n, Vd), (B, n), (B, n)  # fmt: skip
            if self.checkpoint_head and torch.is_grad_enabled():
                kl, agree = grad_checkpoint(_head_stats, self.draft, *args, use_reentrant=False)
            else:
                kl, agree = _head_stats(self.draft, *args)
            loss = loss + (self.decay**i) * kl / norm[i]
            kl_sums.append(kl.detach())
            agree_sums.append(agree)
        return loss, torch.stack(kl_sums), torch.stack(agree_sums)


def step_token_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """(K,) number of loss-masked predicted tokens of each TTT step for a (B, T) loss mask."""
    T = loss_mask.shape[1]
    return torch.stack(
        [loss_mask[:, 2 + i :].sum() if 2 + i < T else loss_mask.new_zeros(()) for i in range(ttt_steps)]
    )


# ---------------------------------------------------------------------------------------------------------
# data: sources, length-grouped batches, collation
# ---------------------------------------------------------------------------------------------------------


class ShardSource:
    """Samples from extracted shards (offline)."""

    def __init__(self, shards):
        self.shards = shards

    def load(self, sids: list[int]) -> list[dict]:
        return [self.shards.load(s) for s in sids]


class OnlineSource:
    """Samples captured from the target in process (online): same dicts as the shards give."""

    def __init__(self, dataset, capture):
        self.dataset = dataset
        self.capture = capture

    def load(self, sids: list[int]) -> list[dict]:
        hs = self.capture.run([self.dataset.input_ids[s] for s in sids])
        return [
            {
                "input_ids": torch.as_tensor(self.dataset.input_ids[s]),
                "loss_mask": torch.as_tensor(self.dataset.loss_mask[s]),
                "hidden": h.clone(),
            }  # clone: capture runs in inference mode  # fmt: skip
            for s, h in zip(sids, hs)
        ]


@dataclass
class Batch:
    """One rank's share of a global batch, padded to its longest sample."""

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float
    aux: torch.Tensor  # (B, T, 3H)
    final: torch.Tensor  # (B, T, H)
    tokens: int  # real (unpadded) tokens


def collate(samples: list[dict], max_length: int) -> Batch:
    """Right-pad samples (truncated to max_length) into one batch; aux slots in ascending id order."""
    T = min(max(int(s["input_ids"].shape[0]) for s in samples), max_length)
    n_slots, H = samples[0]["hidden"].shape[1:]
    assert n_slots == 4, f"expected 4 captured layers (3 aux + final), got {n_slots}"
    B = len(samples)
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T, dtype=torch.float32)  # (B, T)
    hid = torch.zeros(B, T, 4, H, dtype=samples[0]["hidden"].dtype)  # (B, T, 4, H)
    tokens = 0
    for b, s in enumerate(samples):
        n = min(int(s["input_ids"].shape[0]), T)
        ids[b, :n] = s["input_ids"][:n]
        mask[b, :n] = s["loss_mask"][:n].float()
        hid[b, :n] = s["hidden"][:n]
        tokens += n
    aux = hid[:, :, :3].reshape(B, T, 3 * H)  # (B, T, 3H)
    return Batch(ids, mask, aux, hid[:, :, 3], tokens)


def plan_batches(
    sids: list[int], lengths: dict[int, int], max_tokens: int, world: int, seed: int | None
) -> list[list[int]]:
    """Length-grouped global batches within `max_tokens` padded tokens; shuffled when `seed` is given.

    Samples are shuffled, then stably sorted by length and cut greedily; the batch order is shuffled.
    Batches with fewer samples than ranks are dropped (every rank needs at least one sample).
    """
    order = list(sids)
    rng = random.Random(seed) if seed is not None else None
    if rng:
        rng.shuffle(order)
    order.sort(key=lambda s: lengths[s])
    batches = [b for b in token_batches(order, lengths, max_tokens) if len(b) >= world]
    if rng:
        rng.shuffle(batches)
    return batches


def split_sids(sids: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) sample ids: a seeded random `val_fraction` share (at least one when > 0) is held out."""
    if val_fraction <= 0 or len(sids) < 2:
        return list(sids), []
    perm = list(sids)
    random.Random(seed + 7919).shuffle(perm)
    n_val = max(1, round(len(sids) * val_fraction))
    val = set(perm[:n_val])
    return [s for s in sids if s not in val], sorted(val)


# ---------------------------------------------------------------------------------------------------------
# distributed helpers
# ---------------------------------------------------------------------------------------------------------


def _init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world, device): joins the torchrun process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), dev


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    """All-reduce a copy of `t` (moved to the process group's device: NCCL needs CUDA tensors)."""
    if not dist.is_initialized():
        return t
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    r = t.detach().to(dev).clone()
    dist.all_reduce(r, op=op)
    return r.to(t.device)


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.SUM) if dist.is_initialized() else t


def _all_min(t: torch.Tensor) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.MIN) if dist.is_initialized() else t


# ---------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------


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


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _full_states(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state dicts; a collective under FSDP (all ranks call)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=fsdp)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def _save_checkpoint(
    out: Path, step: int, draft_cpu: Eagle3Draft, opt_state: dict, sched, info: dict, keep: int
) -> Path:
    """Write OUT/checkpoints/step_N (draft files + train_state.pt) atomically, point `latest` at it, prune old ones."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft_cpu, tmp)
    state = {
        "step": step,
        "optimizer": opt_state,
        "scheduler": sched.state_dict(),
        "rng": _rng_state(),
        **info,
    }
    torch.save(state, tmp / STATE_FILE)
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_text(root / LATEST_FILE, name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------


def _lr_lambda(cfg: TrainConfig, total: int):
    warm = int(round(cfg.warmup_ratio * total))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return f


def _plan_hash(batches: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16]


@dataclass
class _Setup:
    """Everything `train` needs that depends on the data and the target."""

    source: object
    lengths: dict[int, int]
    train_sids: list[int]
    val_sids: list[int]
    draft: Eagle3Draft
    teacher: TeacherHead
    provenance: dict = field(default_factory=dict)


def _setup(data: str, cfg: TrainConfig, device: torch.device) -> _Setup:
    """Open the data (shards or, online, a dataset + the target), build the draft and the teacher head."""
    from specdraft.targets import capture_layer_ids, load_target

    target_dtype = (
        "bfloat16"
        if (cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")) == "bfloat16"
        else "float32"
    )
    if cfg.online:
        from specdraft.capture.hf import HFCapture
        from specdraft.data.prepare import load_dataset

        ds = load_dataset(data)
        tgt = load_target(cfg.target or ds.manifest.get("target") or "smollm2-135m", device=str(device), dtype=target_dtype,
                          with_tokenizer=False)  # fmt: skip
        layer_ids = capture_layer_ids(tgt.num_layers, cfg.layers)
        n = min(len(ds), cfg.max_samples) if cfg.max_samples else len(ds)
        sids = list(range(n))
        lengths = {s: len(ds.input_ids[s]) for s in sids}
        counts = ds.token_counts
        pad = tgt.model.config.get_text_config().pad_token_id
        source = OnlineSource(ds, HFCapture(tgt, layer_ids, pad_id=pad if isinstance(pad, int) else 0))
        prov = {"mode": "online", "dataset": str(Path(data).resolve()), "layer_ids": layer_ids}
    else:
        from specdraft.data.store import ShardSet

        ss = ShardSet.open([p for p in data.split(",") if p])
        man = ss.manifest
        layer_ids = list(man["layer_ids"])
        tinfo = man["target"]
        name = cfg.target or tinfo.get("path") or tinfo.get("name")
        if not cfg.target and tinfo.get("path") and not Path(tinfo["path"]).exists():
            name = tinfo.get("name")
        tgt = load_target(name, device=str(device), dtype=target_dtype, with_tokenizer=False)
        if tinfo.get("config_hash") and tgt.config_hash != tinfo["config_hash"]:
            raise ValueError(f"the target {name} (config hash {tgt.config_hash}) is not the one the shards were "
                             f"extracted from ({tinfo.get('name')}, hash {tinfo['config_hash']}): pass --target with "
                             "the extraction's model")  # fmt: skip
        sids = ss.sample_ids()
        if not all(m.get("complete") for m in ss.manifests):
            print(f"train: warning: the extraction in {data} is not complete; training on the {len(sids)} samples "
                  "of its finished shards (rerun `specdraft extract` to finish it)", flush=True)  # fmt: skip
        if cfg.max_samples:
            sids = sids[: cfg.max_samples]
        lengths = {s: ss.length(s) for s in sids}
        counts = ss.token_counts()
        source = ShardSource(ss)
        prov = {"mode": "offline", "shards": data, "layer_ids": layer_ids}
    if len(layer_ids) != 4:
        raise ValueError(f"EAGLE-3 needs 3 aux layers + the final layer; the data has layer ids {layer_ids}")
    lengths = {s: min(n, cfg.max_length) for s, n in lengths.items() if n >= 3}
    train_sids, val_sids = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    draft = build_draft(tgt, counts, layer_ids[:3], cfg.draft_vocab_size, cfg.norm_before_residual,
                        cfg.init_lm_head, seed=cfg.seed)  # fmt: skip
    teacher = TeacherHead(tgt, draft.t2d).to(device)
    prov.update({"target": getattr(tgt, "path", "") or tgt.name, "target_config_hash": tgt.config_hash})
    return _Setup(source, lengths, train_sids, val_sids, draft.to(device), teacher, prov)


def _to_device(b: Batch, device: torch.device) -> Batch:
    nb = device.type == "cuda"
    return Batch(b.input_ids.to(device, non_blocking=nb), b.loss_mask.to(device, non_blocking=nb),
                 b.aux.to(device, torch.float32, non_blocking=nb), b.final.to(device, non_blocking=nb), b.tokens)  # fmt: skip


def _evaluate(
    model: TTTModel,
    teacher: TeacherHead,
    batches: list[list[int]],
    load,
    cfg: TrainConfig,
    device,
    amp,
    rank,
    world,
) -> dict:
    """Validation: global masked-token means of the loss and per-step accuracy over the val batches."""
    K = cfg.ttt_steps
    kl, agree, cnt = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    with torch.no_grad():
        for sids in batches:
            b = _to_device(collate(load(sids[rank::world]), cfg.max_length), device)
            counts = step_token_counts(b.loss_mask, K).float().cpu()
            with amp():
                logp = F.log_softmax(teacher(b.final), dim=-1)  # (B, T, Vd)
                _, k_s, a_s = model(b.input_ids, b.aux, logp, b.loss_mask, torch.ones(K, device=device))
            kl += k_s.float().cpu()
            agree += a_s.float().cpu()
            cnt += counts
    kl, agree, cnt = _all_sum(kl), _all_sum(agree), _all_sum(cnt)
    per = kl / cnt.clamp(min=1)
    w = torch.tensor([cfg.decay**i for i in range(K)])
    return {"loss": float((w * per).sum()), "kl": per.tolist(), "acc": (agree / cnt.clamp(min=1)).tolist(),
            "tokens": int(cnt[0])}  # fmt: skip


def train(shards: str, out: str, cfg: TrainConfig = _DEFAULTS) -> Path:
    """Train an EAGLE-3 draft with training-time test; returns OUT/final (the trained draft).

    Args:
        shards: extraction directory (several: comma-separated) from `specdraft extract`; with --online a
            prepared dataset directory from `specdraft prepare`.
        out: output directory: checkpoints/, final/, metrics.jsonl (rerun with --resume to continue).
    """
    errors = cfg.problems()
    if not cfg.online and not any(Path(p).is_dir() for p in shards.split(",") if p):
        errors.append(
            f"{shards} is not a directory: pass an extraction directory (or --online with a dataset)"
        )
    out_dir = Path(out)
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None and not cfg.resume:
        errors.append(f"{out_dir} already holds checkpoints (newest {ckpt.name}): pass --resume to continue, "
                      "or choose a new --out")  # fmt: skip
    if cfg.resume and ckpt is None:
        errors.append(f"--resume: no checkpoint under {out_dir}/checkpoints to resume from")
    if errors:
        raise ValueError("train: " + "; ".join(errors))

    # --- setup: processes, data, draft, teacher, optimizer, schedule --------------------------------------
    rank, world, device = _init_distributed(cfg.device)
    torch.manual_seed(cfg.seed)
    amp_dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    use_amp = amp_dtype == "bfloat16"

    def amp():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp)

    st = _setup(shards, cfg, device)
    if cfg.max_tokens < cfg.max_length * world and world > 1:
        longest = max(st.lengths.values())
        if longest * world > cfg.max_tokens:
            raise ValueError(f"train: --max-tokens {cfg.max_tokens} cannot hold {world} samples of up to {longest} "
                             f"tokens (one per rank): raise --max-tokens or lower --max-length")  # fmt: skip
    batches0 = plan_batches(st.train_sids, st.lengths, cfg.max_tokens, world, cfg.seed)
    per_epoch = len(batches0)
    if per_epoch == 0:
        raise ValueError(f"train: no training batch: {len(st.train_sids)} training samples of length >= 3 "
                         f"for {world} ranks; add data or lower --val-fraction")  # fmt: skip
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    val_batches = plan_batches(st.val_sids, st.lengths, cfg.max_tokens, world, None)

    model = TTTModel(st.draft, cfg.ttt_steps, cfg.decay, cfg.checkpoint_head)
    wrapped: nn.Module = model
    if world > 1 and cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        # shard at the TTT module: its forward gathers the parameters once for all K steps (the draft's fuse and
        # compute_logits are called inside it); kept gathered until backward, where the head is recomputed
        fully_shard(model, reshard_after_forward=False)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          broadcast_buffers=False)  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, total))
    start = 0

    # --- resume: model, optimizer, scheduler, RNG, data position ------------------------------------------
    if cfg.resume:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
        old = state["config"]
        changed = [k for k, v in asdict(cfg).items() if k not in _RESUME_FREE and old.get(k) != v]
        if state["world"] != world:
            changed.append(f"{state['world']} ranks instead of {world}")
        if changed or state["plan_hash"] != _plan_hash(batches0):
            raise ValueError(f"train --resume: {ckpt} was written with other settings ({', '.join(changed) or 'data'}): "
                             "resume with the same settings and data, or start a new --out")  # fmt: skip
        opts = StateDictOptions(full_state_dict=True)
        weights = {f"draft.{k}": v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
        set_model_state_dict(model, weights, options=opts)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        start = state["step"]
        if rank == 0:
            print(f"train: resuming from {ckpt} at step {start}/{total}", flush=True)

    # --- logging: metrics jsonl (+ TensorBoard), progress bar (rank 0 only) -------------------------------
    metrics_path = out_dir / METRICS_FILE
    tb = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume and metrics_path.exists():  # drop records past the checkpoint: they will be redone
            keep = [
                ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start
            ]
            _atomic_text(metrics_path, "".join(ln + "\n" for ln in keep))
        elif not cfg.resume:
            metrics_path.write_text("")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                tb = None
        n_train_params = sum(p.numel() for p in params)
        print(f"train: {len(st.train_sids)} train / {len(st.val_sids)} val samples, {per_epoch} steps/epoch, "
              f"{total} steps, {world} rank(s), draft {n_train_params / 1e6:.2f}M trainable params, "
              f"Vd={st.draft.cfg.draft_vocab_size}, K={cfg.ttt_steps}, {amp_dtype} on {device}", flush=True)  # fmt: skip

    def log(rec: dict) -> None:
        if rank != 0:
            return
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    tb.add_scalar(f"{rec.get('split', 'train')}/{k}", v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        tb.add_scalar(f"{rec.get('split', 'train')}/{k}_{i}", x, rec["step"])

    def validate(step: int) -> dict | None:
        if not val_batches:
            return None
        r = _evaluate(model, st.teacher, val_batches, st.source.load, cfg, device, amp, rank, world)
        log({"split": "val", "step": step, **r})
        if rank == 0:
            accs = " ".join(f"{a:.3f}" for a in r["acc"])
            print(f"train: step {step} val loss {r['loss']:.4f} acc/step [{accs}]", flush=True)
        return r

    last_ckpt = str(ckpt) if cfg.resume else "none"
    info = {
        "config": asdict(cfg),
        "world": world,
        "plan_hash": _plan_hash(batches0),
        "provenance": st.provenance,
    }

    def checkpoint(step: int) -> str:
        full_model, full_opt = _full_states(model, optimizer, cfg.fsdp and world > 1)
        path = ""
        if rank == 0:
            draft_cpu = _draft_from_state(st.draft, full_model) if (cfg.fsdp and world > 1) else st.draft
            path = str(
                _save_checkpoint(out_dir, step, draft_cpu, full_opt, scheduler, info, cfg.keep_checkpoints)
            )
        if world > 1:
            dist.barrier()
        return path

    if start == 0 and (cfg.val_every or cfg.val_fraction):
        validate(0)

    # --- the loop ---------------------------------------------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(
        total=total, initial=start, disable=rank != 0 or not cfg.progress, unit="step", dynamic_ncols=True
    )
    pool = ThreadPoolExecutor(1) if cfg.prefetch and not cfg.online else None
    K = cfg.ttt_steps

    def epoch_batches(epoch: int) -> list[list[int]]:
        return plan_batches(st.train_sids, st.lengths, cfg.max_tokens, world, cfg.seed * 100003 + epoch)

    def load_local(sids: list[int]) -> Batch:
        return collate(st.source.load(sids[rank::world]), cfg.max_length)  # this rank's rows only

    step = start
    epoch, idx = divmod(start, per_epoch)
    plan = epoch_batches(epoch)
    pending = pool.submit(load_local, plan[idx]) if pool else None
    t_log, tok_log, data_time, step_time = time.time(), 0, 0.0, 0.0
    model.train()
    try:
        while step < total:
            t0 = time.time()
            # data: this step's rows (prefetched), the next step's load started in the background
            sids = plan[idx]
            b = pending.result() if pending else load_local(sids)
            nxt_epoch, nxt_idx = (epoch, idx + 1) if idx + 1 < per_epoch else (epoch + 1, 0)
            if nxt_epoch != epoch:
                nxt_plan = epoch_batches(nxt_epoch)
            else:
                nxt_plan = plan
            if pool and step + 1 < total:
                pending = pool.submit(load_local, nxt_plan[nxt_idx])
            b = _to_device(b, device)
            counts = _all_sum(
                step_token_counts(b.loss_mask, K).float()
            )  # (K,) global masked tokens per TTT step
            tokens = int(_all_sum(torch.tensor(float(b.tokens))).item())
            t_data = time.time() - t0

            # forward: teacher distribution, then the K-step TTT unroll
            with torch.no_grad(), amp():
                logp = F.log_softmax(st.teacher(b.final), dim=-1)  # (B, T, Vd) teacher log-probs, fp32
            with amp():
                loss, kl_s, agree_s = wrapped(
                    b.input_ids, b.aux, logp, b.loss_mask, counts.clamp(min=1) / world
                )

            # non-finite check before anything changes (all ranks agree, the last checkpoint stays intact)
            ok = _all_min(torch.tensor(float(torch.isfinite(loss).item()), device=device))
            if ok.item() < 1:
                raise NonFiniteError(f"non-finite loss at step {step + 1} (epoch {epoch}, batch {idx} of the epoch, "
                                     f"samples {sids}); nothing of this step was applied, last good checkpoint: "
                                     f"{last_ckpt}. Check those samples' hidden states (specdraft verify) or lower "
                                     "--lr")  # fmt: skip

            # backward, clip, check the gradient, step
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(
                params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            )
            gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
            if not math.isfinite(gnorm):
                raise NonFiniteError(f"non-finite gradient at step {step + 1} (epoch {epoch}, batch {idx} of the "
                                     f"epoch, samples {sids}); the update was not applied, last good checkpoint: "
                                     f"{last_ckpt}. Lower --lr or check those samples")  # fmt: skip
            optimizer.step()
            scheduler.step()
            step += 1
            epoch, idx, plan = nxt_epoch, nxt_idx, nxt_plan
            step_time += time.time() - t0
            data_time += t_data
            tok_log += tokens

            # log: global per-step KL and accuracy, tokens/s, data-loading share
            if step % cfg.log_every == 0 or step == total:
                kl_g, ag_g = _all_sum(kl_s.float()), _all_sum(agree_s.float())
                c = counts.clamp(min=1)
                acc = (ag_g / c).tolist()
                dt = time.time() - t_log
                rec = {"split": "train", "step": step, "epoch": round(step / per_epoch, 4),
                       "loss": float(sum(cfg.decay**i * kl_g[i] / c[i] for i in range(K))), "kl": (kl_g / c).tolist(),
                       "acc": acc, "lr": scheduler.get_last_lr()[0], "grad_norm": gnorm, "tokens": tokens,
                       "tokens_per_s": tok_log / max(dt, 1e-9), "data_share": data_time / max(step_time, 1e-9)}  # fmt: skip
                log(rec)
                bar.set_postfix_str(f"loss {rec['loss']:.3f} acc {'/'.join(f'{a:.2f}' for a in acc[:4])} "
                                    f"{rec['tokens_per_s']:.0f} tok/s")  # fmt: skip
                t_log, tok_log, data_time, step_time = time.time(), 0, 0.0, 0.0
            bar.update(1)

            # validate and checkpoint
            if cfg.val_every and step % cfg.val_every == 0 and step < total:
                validate(step)
            if step % cfg.checkpoint_every == 0 and step < total:
                last_ckpt = checkpoint(step)
            _after_step(step)
    finally:
        bar.close()
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)

    # --- end: final validation, final checkpoint, the trained draft ---------------------------------------
    val = validate(step)
    checkpoint(step)
    final = out_dir / "final"
    if rank == 0:
        draft_cpu = st.draft if not (cfg.fsdp and world > 1) else load_draft(latest_checkpoint(out_dir))
        save_draft(draft_cpu, final, extra={"train": {"steps": step, "val": val, **st.provenance}})
        plot_metrics(metrics_path, out_dir / "training.png")
        if tb is not None:
            tb.close()
        print(f"train: done, {step} steps -> {final}", flush=True)
    if world > 1:
        dist.barrier()
    return final


def plot_metrics(metrics_path: Path, png: Path) -> Path | None:
    """training.png: loss and per-TTT-step accuracy against the step, train and validation."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("val", "o--")):
        rs = [r for r in recs if r.get("split") == split]
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        ax_loss.plot(steps, [r["loss"] for r in rs], style, label=split)
        for i in range(len(rs[0]["acc"])):
            ax_acc.plot(
                steps,
                [r["acc"][i] for r in rs],
                style,
                label=f"{split} step {i}",
                alpha=0.5 if split == "train" else 1.0,
            )
    ax_loss.set(xlabel="optimizer step", ylabel="loss (sum over TTT steps, decayed)", title="loss")
    ax_acc.set(
        xlabel="optimizer step", ylabel="top-1 agreement with the target", title="accuracy per TTT step"
    )
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _draft_from_state(draft: Eagle3Draft, full_model_state: dict) -> Eagle3Draft:
    """A CPU copy of the draft holding a full model state (keys `draft.*` of the TTT model)."""
    cpu = Eagle3Draft(draft.cfg)
    cpu.load_state_dict({k.removeprefix("draft."): v for k, v in full_model_state.items()}, strict=True)
    return cpu
