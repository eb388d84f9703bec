"""TrainConfig: the settings of `specdraft train`, their checks, and which of them may change on --resume.

Each field's `# comment` (or, where it is too long for the line, the docstring under it) is its `--help`
text: tyro reads it from this source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch

from specdraft.model.checkpoint import draft_dir, load_draft_config
from specdraft.train.losses import BLOCK_LOSSES, OWN_LOSS, parse_loss
from specdraft.train.report.metrics import tracker_problems


@dataclass
class TrainConfig:
    """Settings of `specdraft train`; the library defaults are EAGLE-3's."""

    target: str = ""  # target model (dir, hub id, smollm2-135m); default: the shards' manifest's
    trust_remote_code: bool = False  # allow model code shipped with the target (config, tokenizer)
    skip_bad: bool = False  # skip shards that fail their checks (counted and named) instead of stopping
    allow_partial: bool = False  # train on an incomplete extraction (samples missing), saying how many
    online: bool = False  # capture hidden states from the target in process (DATA is then a prepared dataset)
    layers: list[int] | None = None  # aux layer ids for --online (default 2, L//2, L-3)
    backend: Literal["hf", "vllm"] = "hf"
    """--online: capture in process with transformers (hf) or through a vLLM engine (vllm; under torchrun rank 0 runs it for every rank)"""
    tensor_parallel_size: int = 1  # --online --backend vllm: the engine's tensor parallel size
    engine_args: str = ""  # --online --backend vllm: more vllm.LLM options (JSON), checked before loading
    init_from: str = ""  # start from a trained draft (a final/, a checkpoint, or a train OUT): its weights and draft vocabulary, with a new optimizer and schedule (more data for a finished draft)
    draft_vocab_size: int = 32000  # draft vocabulary size (top tokens by frequency), capped at the target's
    norm_before_residual: bool = False  # residual = hidden_norm(h) (speculators variant) instead of h
    init_lm_head: bool = True  # start lm_head from the target's rows of the draft vocabulary
    fc_init: Literal["random", "high"] = "random"
    """fc starts random (EAGLE-3), or high: the identity on the highest aux layer"""
    ttt_steps: int = 7  # training-time-test unroll depth K (EAGLE-3: 7; speculators: 3)
    decay: float = 0.8  # weight of TTT step i is decay**i
    oov_mask: bool = True  # drop positions whose target argmax is outside the draft vocabulary (EAGLE-3)
    hard_weight: float = 0.0
    """loss: (1 - w) x the soft loss of --loss + w x cross-entropy on the target's argmax"""
    loss: str = ""
    """the loss against the target's distribution: kl, rkl (reverse KL), jsd, tv (1 - acceptance), nla (-log acceptance), lk (KL/TV blend by acceptance), for DFlash also ce (cross-entropy on the next token), or a weighted sum such as 0.5*kl+0.5*tv; empty: the draft's own (EAGLE-3: kl, the soft part of --hard-weight; DFlash: ce)"""
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux layer's hidden state before fc
    norm_output: bool = False
    """EAGLE-3.1: feed the post-norm hidden state back across TTT steps, as served"""
    noise: Literal["none", "uniform", "gaussian"] = "none"
    """noise on the target's aux features while training, --noise-scale times each state's RMS per token: none, uniform (U(-1, 1)), gaussian"""
    noise_scale: float = 0.0  # --noise: its size relative to each aux state's RMS
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (orthogonalised momentum) on the draft's hidden matrices, AdamW on lm_head, norms and biases"""
    prompt_loss: bool = False  # also train on prompt tokens (the target is the teacher there too)
    epochs: int = 1  # passes over the training split
    steps_per_batch: int = 1  # optimizer steps per batch, each on the next contiguous 1/N of every row's scored tokens (full context each time)
    max_steps: int = 0  # stop after this many optimizer steps (0 = run all epochs)
    max_tokens: int = 4096  # padded tokens per optimizer step, summed over all ranks (length-grouped batches)
    max_length: int = 2048  # longer samples are truncated to this many tokens
    max_samples: int = 0  # use only the first N samples (0 = all)
    recipe: Literal["auto", "on", "off"] = "auto"
    """the small-run recipe (lr 1e-3, 512 tokens a step, constant, prompt loss, decay 0.5, Muon, 2 steps a batch, fc-init high, EMA 0.99), measured best on the scaling curve (DFlash: the same lr, tokens a step and schedule, block 4, 16 anchors): auto fills the settings not given under 500k scored tokens (and says which came from where), on fills them at any size, off never"""
    serve_temperature: float = -1.0
    """the temperature the draft will be served at (-1: not said): with the small-run recipe, 1 or more trains with the NLA loss (-log acceptance) unless --loss is given (measured best at T = 1 with probabilistic drafting, two seeds, over the soft KL and TV; a tie with the KL at 0.7: docs/experiments.md)"""
    lr: float = 1e-4  # peak learning rate (of AdamW, and of Muon: its updates scaled to AdamW's RMS)
    min_lr_ratio: float = 0.0  # final learning rate as a fraction of the peak
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """after warmup: cosine, linear, constant, wsd (constant, linear at the end)"""
    cooldown_ratio: float = 0.2  # wsd: share of all steps, at the end, decaying to --min-lr-ratio
    warmup_ratio: float = 0.015  # warmup length as a fraction of all steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 0.5  # clip the global gradient norm to this (0 = off)
    ema: float = 0.0  # final/ holds a moving average of the weights: step s of t weighted EMA**(t-s), bias-corrected (normalised; the init has no weight) (0 = off)
    val_fraction: float = 0.02  # share of samples held out for validation (at least 1 when > 0)
    val_every: int = 0  # validate every N steps (0 = only before and after training)
    log_every: int = 1  # write a metrics record every N steps
    checkpoint_every: int = 500  # write a resumable checkpoint every N steps (and always at the end)
    keep_checkpoints: int = 2  # how many step checkpoints to keep (the newest)
    resume: bool = False  # continue exactly from the newest checkpoint in OUT
    seed: int = 0  # seed of the draft's init and of the data order
    device: str = "auto"  # auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda[:N] (under torchrun: cuda:LOCAL_RANK)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """compute dtype: auto (bfloat16 on a GPU that supports it, else float32), float32, bfloat16 (autocast)"""
    fsdp: bool = False  # shard the draft with FSDP2 fully_shard instead of DDP (distributed runs)
    attention_chunk: int = 1 << 25  # TTT attention: causal scores held at a time (elements; memory, not math)
    checkpoint_head: Literal["auto", "on", "off"] = "auto"
    """recompute lm_head + loss in backward: on, off, or auto (on when K x tokens x Vd activations exceed 2 GiB)"""
    checkpoint_layer: bool = False  # recompute each TTT step's layer in backward (long samples)
    prefetch: bool = True  # load (shards) or capture (--online --backend vllm) batches in a background thread
    prefetch_depth: int = 2  # how many batches the background thread prepares ahead (a bounded queue)
    tensorboard: bool = True  # also log to OUT/tb when the tensorboard package is installed
    report_to: str = ""  # also report to, comma-separated: tensorboard, wandb, trackio, mlflow (offline, in OUT, unless WANDB_MODE, MLFLOW_TRACKING_URI, TRACKIO_SPACE_ID say otherwise)
    project: str = ""  # --report-to: the trackers' project (MLflow: experiment); empty = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME when set, else the name of OUT's parent directory
    run_name: str = ""
    """--report-to: the run's name in the trackers; empty = WANDB_NAME when set, else OUT's name"""
    progress: bool = True  # show a progress bar
    draft: Literal["eagle3", "dflash"] = "eagle3"
    """the draft to train: eagle3 (TTT), or dflash (block-parallel: one forward drafts a block; fuses every aux layer the data holds)"""
    block_size: int = 8  # --draft dflash: tokens per block, the anchor then block_size - 1 drafted
    draft_layers: int = 1  # decoder layers of the draft (EAGLE-3: the first reads 2H, later ones H)
    anchors: int = 64  # --draft dflash: blocks (anchors) sampled per sequence per step
    mask_token_id: int = -1
    """--draft dflash: token id the served format puts in mask slots (-1 = the last vocabulary row)"""
    train_mask_embedding: bool = True  # --draft dflash: train the mask slots' embedding (vLLM reads it from mask_embedding.pt); off keeps the target's embedding of --mask-token-id, which SGLang needs
    position_weights: Literal["exp", "dpace"] = "exp"
    """--draft dflash: weight of block slot i in the loss: exp (exp(-(i-1)/gamma)) or dpace (the chance the block reaches slot i: the draft's probability of every earlier label, detached)"""

    def problems(self) -> list[str]:
        """Every user error in these settings (empty when all is well)."""
        errs = [f"--{f.name.replace('_', '-')} must be a finite number, not {getattr(self, f.name)}" for f in fields(self)
                if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))]  # fmt: skip
        for name in ("ttt_steps", "epochs", "steps_per_batch", "max_tokens", "max_length", "draft_vocab_size", "log_every",
                     "checkpoint_every", "keep_checkpoints", "attention_chunk", "draft_layers"):  # fmt: skip
            if getattr(self, name) < 1:
                errs.append(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        for name in ("max_steps", "max_samples", "val_every", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                errs.append(f"--{name.replace('_', '-')} must not be negative, not {getattr(self, name)}")
        if not 0 <= self.hard_weight <= 1:
            errs.append(f"--hard-weight must be in [0, 1], not {self.hard_weight}")
        if not 0 < self.decay <= 1:
            errs.append(f"--decay must be in (0, 1], not {self.decay}")
        if (
            math.isfinite(self.lr) and not 0 < self.lr <= 1
        ):  # AdamW and Muon move each weight by about the learning rate a step
            errs.append(f"--lr must be in (0, 1], not {self.lr}: the recipe's is 1e-3")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup_ratio < 1:
            errs.append("--min-lr-ratio must be in [0, 1] and --warmup-ratio in [0, 1)")
        if not 0 <= self.val_fraction < 1:
            errs.append(f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        if not 0 <= self.ema < 1:
            errs.append(f"--ema must be in [0, 1), not {self.ema}")
        if self.ema and self.fsdp:
            errs.append("--ema with --fsdp is not supported yet (the average is kept whole): drop one")
        if self.draft not in ("eagle3", "dflash"):
            errs.append(f"--draft must be eagle3 or dflash, not {self.draft!r}")
        errs += unused_problems(self)
        errs += loss_problems(self)
        if self.noise not in ("none", "uniform", "gaussian") or self.noise_scale < 0:
            errs.append(f"--noise must be none, uniform or gaussian and --noise-scale not negative, not "
                        f"{self.noise!r} and {self.noise_scale}")  # fmt: skip
        elif (self.noise == "none") != (self.noise_scale == 0):
            errs.append(
                "--noise and --noise-scale go together: give both (e.g. --noise uniform --noise-scale 0.05)"
            )
        if self.optimizer not in ("adamw", "muon"):
            errs.append(f"--optimizer must be adamw or muon, not {self.optimizer!r}")
        elif self.optimizer == "muon" and self.fsdp:
            errs.append(
                "--optimizer muon with --fsdp is not supported (Muon orthogonalises whole matrices): drop one"
            )
        if self.position_weights not in ("exp", "dpace"):
            errs.append(f"--position-weights must be exp or dpace, not {self.position_weights!r}")
        if self.fc_init not in ("random", "high"):
            errs.append(f"--fc-init must be random or high, not {self.fc_init!r}")
        if self.schedule not in ("cosine", "linear", "constant", "wsd"):
            errs.append(f"--schedule must be cosine, linear, constant or wsd, not {self.schedule!r}")
        if not 0 < self.cooldown_ratio <= 1:
            errs.append(f"--cooldown-ratio must be in (0, 1], not {self.cooldown_ratio}")
        if self.checkpoint_head not in ("auto", "on", "off"):
            errs.append(f"--checkpoint-head must be auto, on or off, not {self.checkpoint_head!r}")
        if self.dtype not in ("", "auto", "float32", "bfloat16"):
            errs.append(f"--dtype must be float32 or bfloat16, not {self.dtype!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            errs.append(f"--device must be auto, cpu or cuda[:N], not {self.device!r}")
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            errs.append(f"--device {self.device}: CUDA is not available here; use --device cpu")
        if self.layers is not None and not self.online:
            errs.append("--layers applies to --online only (offline, the shards' layer ids are used)")
        if self.backend not in ("hf", "vllm"):
            errs.append(f"--backend must be hf or vllm, not {self.backend!r}")
        elif self.backend == "vllm" and not self.online:
            errs.append(
                "--backend vllm applies to --online only (offline, the shards hold the hidden states)"
            )
        if self.backend != "vllm" and (self.tensor_parallel_size != 1 or self.engine_args):
            errs.append(
                "--tensor-parallel-size and --engine-args are vLLM options: add --online --backend vllm"
            )
        if self.tensor_parallel_size < 1 or self.prefetch_depth < 1:
            errs.append("--tensor-parallel-size and --prefetch-depth must be at least 1")
        if self.recipe not in ("auto", "on", "off"):
            errs.append(f"--recipe must be auto, on or off, not {self.recipe!r}")
        errs += [e for e in [serve_temperature_problem(self.serve_temperature)] if e]
        errs += tracker_problems(self.report_to)
        errs += init_problems(self)
        if self.max_length < 3:
            errs.append("--max-length must be at least 3 (a draft position needs tokens t, t+1, t+2)")
        return errs


# the settings one draft kind does not use: away from their default they are refused, never recorded and ignored
EAGLE3_ONLY = ("fc_norm", "norm_output", "noise", "noise_scale", "ttt_steps", "decay", "oov_mask",
               "hard_weight", "fc_init", "norm_before_residual")  # fmt: skip
DFLASH_ONLY = ("block_size", "anchors", "mask_token_id", "train_mask_embedding", "position_weights")


def unused_problems(cfg: TrainConfig) -> list[str]:
    """Settings given away from their default for a draft kind that does not use them, each with the fix."""
    if cfg.draft == "eagle3":
        names, other = DFLASH_ONLY, "--draft dflash"
    else:
        names, other = EAGLE3_ONLY, "EAGLE-3 (the default --draft eagle3)"
    off = [k for k in names if getattr(cfg, k) != getattr(_DEFAULTS, k)]
    return [f"--draft {cfg.draft} does not use {flags({k: getattr(cfg, k)})}: it is a setting of {other}; drop it"
            for k in off]  # fmt: skip


def loss_problems(cfg: TrainConfig) -> list[str]:
    """--loss: a spec the draft kind cannot train with, with the fix."""
    try:
        terms = parse_loss(cfg.loss or OWN_LOSS.get(cfg.draft, "kl"), BLOCK_LOSSES)
    except ValueError as e:
        return [str(e)]
    if "ce" in terms and cfg.draft != "dflash":
        return [f"--loss {cfg.loss}: ce is DFlash's loss; for EAGLE-3, --hard-weight 1 trains on the target's argmax "
                "(cross-entropy; the default 0 trains on --loss alone, kl unless given)"]  # fmt: skip
    return []


def with_own_loss(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with --loss resolved (empty: the draft kind's own, `OWN_LOSS`): what a run records and trains with."""
    return cfg if cfg.loss else replace(cfg, loss=OWN_LOSS.get(cfg.draft, "kl"))


def flags(settings: dict) -> str:
    """`train`'s command-line spelling of TrainConfig settings (a bool is --flag / --no-flag)."""
    flag = lambda k: k.replace("_", "-")  # noqa: E731
    return " ".join(
        (f"--{'' if v else 'no-'}{flag(k)}" if isinstance(v, bool) else f"--{flag(k)} {v}")
        for k, v in settings.items()
    )


def init_problems(cfg: TrainConfig) -> list[str]:
    """--init-from: the settings' disagreements with the draft it names (each with its fix). A new run from a
    trained draft takes its weights and draft vocabulary, with a new optimizer, schedule and EMA (`setup.warm_draft`).
    """
    if not cfg.init_from:
        return []
    p = draft_dir(cfg.init_from)
    if p is None:
        return [
            f"--init-from {cfg.init_from}: no saved draft there (a final/, checkpoints/step_N, or a train OUT)"
        ]
    try:
        dc = load_draft_config(p)
    except (OSError, ValueError) as e:
        return [f"--init-from {cfg.init_from}: {e}"]
    errs = []
    # the draft's own sizes: taken from it unless given otherwise (a setting left at its default is not given)
    for key, ours, theirs in (("draft_vocab_size", cfg.draft_vocab_size, dc.draft_vocab_size),
                              ("norm_before_residual", cfg.norm_before_residual, dc.norm_before_residual),
                              ("fc_norm", cfg.fc_norm, dc.fc_norm), ("norm_output", cfg.norm_output, dc.norm_output),
                              ("draft_layers", cfg.draft_layers, dc.num_hidden_layers)):  # fmt: skip
        if ours != theirs and ours != getattr(TrainConfig, key):
            errs.append(f"--init-from {p} was built with {key}={theirs}: drop {flags({key: ours})} (the draft's "
                        f"own is used) or pass {flags({key: theirs})}")  # fmt: skip
    return errs


_DEFAULTS = TrainConfig()

#: the settings a run trains with, in OUT and in OUT/final: `specdraft train --config FILE` reads it back
SETTINGS_FILE = "train_settings.json"


def run_settings(shards: str, out_dir, cfg: TrainConfig) -> dict:
    """`train`'s flat settings (the positionals, then every TrainConfig field but --resume, a way of running
    them rather than one of them: the file starts a run like it, or resumes it with --resume): its content."""
    from dataclasses import asdict

    return {"shards": shards, "out": str(out_dir), **{k: v for k, v in asdict(cfg).items() if k != "resume"}}


# the small-run recipe: measured against the defaults above along the scaling curve (docs/experiments.md)
# (the soft KL, the library default, and Muon replaced the argmax loss and AdamW after issue 45's side-by-side: +0.026
# and +0.043 tau at 305k reply tokens over two seeds, docs/experiments.md)
SMALL_RUN = {"lr": 1e-3, "max_tokens": 512, "schedule": "constant", "prompt_loss": True, "decay": 0.5,
             "optimizer": "muon", "steps_per_batch": 2, "fc_init": "high", "ema": 0.99}  # fmt: skip
# DFlash's: the optimizer settings above, and the block and anchors the side-by-side picked at three data sizes
# (docs/dflash.md; the defaults 8 and 64 stay for large data, where published DFlash drafts use long blocks)
DFLASH_SMALL_RUN = {"lr": 1e-3, "max_tokens": 512, "schedule": "constant", "block_size": 4, "anchors": 16}
#: the recipe's settings --fsdp leaves at the library default (AdamW, no EMA), and why
FSDP_LEAVES = ("optimizer", "ema")
FSDP_WHY = "neither shards yet: Muon orthogonalises whole matrices, the EMA is kept whole"
# scored tokens: `--recipe auto` applies SMALL_RUN to smaller data (the curve's measured range)
SMALL_RUN_BELOW = 500_000
#: serving temperatures from which the small-run recipe trains an EAGLE-3 draft with SERVED_LOSS, NLA (-log acceptance):
#: measured at T = 1 with probabilistic drafting, two seeds, against the soft KL (+0.052, +0.029) and TV (+0.022,
#: +0.023); at 0.7 a tie with the KL (+0.026, -0.011), kept below (docs/experiments.md, "Served at a temperature")
SERVED_FROM_TEMPERATURE = 1.0
SERVED_LOSS = "nla"


def serve_temperature_problem(temperature: float) -> str:
    """--serve-temperature out of range, with the fix ("" when fine): -1 (not said) or in [0, 2]."""
    if temperature != -1 and not 0 <= temperature <= 2:
        return f"--serve-temperature must be -1 (not said: the target's own) or in [0, 2], not {temperature}"
    return ""


def loss_for_serving(temperature: float) -> str:
    """The small-run recipe's loss for an EAGLE-3 draft served at ``temperature`` (-1: not said): SERVED_LOSS from
    SERVED_FROM_TEMPERATURE, else "" (the draft's own, the soft KL)."""
    return SERVED_LOSS if temperature >= SERVED_FROM_TEMPERATURE else ""


def with_recipe(cfg: TrainConfig, scored: int, recipe: dict = SMALL_RUN, world: int = 1,
                longest: int = 0) -> tuple[TrainConfig, str]:  # fmt: skip
    """The settings a run trains with, and a line saying which of the recipe's settings came from where ("" when
    the recipe does not apply).

    `on` fills in `recipe` (SMALL_RUN, or DFLASH_SMALL_RUN for a DFlash draft) for each of its settings not
    given; `auto` does so under SMALL_RUN_BELOW scored tokens. Given: named on the command line or in a --config file (`runtime.GIVEN`), or away from the library
    default. A Python caller (no command line) that sets any of them gets `auto` as off: it is tuning. EMA and
    Muon are left out under --fsdp (not supported there yet). The recipe's tokens a step are raised, where they cannot
    hold one sample of the data's `longest` (after --max-length) per rank of `world` > 1, to the smallest
    multiple of 512 that can (and the line says so; one process takes a longer sample as a batch of its own)."""
    from specdraft import runtime

    if cfg.draft == "eagle3" and loss_for_serving(cfg.serve_temperature):  # a draft served at T >= 1
        recipe = {**recipe, "loss": loss_for_serving(cfg.serve_temperature)}
    given = runtime.GIVEN if runtime.FROM_COMMAND_LINE else {}
    source = {
        k: given.get(k, "given") for k in recipe if k in given or getattr(cfg, k) != getattr(_DEFAULTS, k)
    }
    tuned = bool(source) and not runtime.FROM_COMMAND_LINE
    runtime.FILLED.clear()
    if cfg.recipe == "off" or (cfg.recipe == "auto" and (tuned or scored >= SMALL_RUN_BELOW)):
        return cfg, ""
    fill = {k: v for k, v in recipe.items() if k not in source and not (k in FSDP_LEAVES and cfg.fsdp)}
    if cfg.init_from:  # its weights are loaded: no init setting applies
        fill.pop("fc_init", None)
    raised = ""
    if (
        "max_tokens" in fill and world > 1 and fill["max_tokens"] < world * longest
    ):  # a sample per rank a step
        need = -(-world * longest // 512) * 512
        raised = (f" (--max-tokens raised from the recipe's {fill['max_tokens']} to {need}: one sample of up to "
                  f"{longest} tokens for each of {world} ranks)")  # fmt: skip
        fill["max_tokens"] = need
    why = "--recipe on" if cfg.recipe == "on" else f"{scored:,} scored tokens, under {SMALL_RUN_BELOW:,}"
    if "loss" in fill:
        why += f"; served at T={cfg.serve_temperature:g}: the NLA loss"
    parts = [f"the small-run recipe ({why}): {flags(fill) or 'nothing left to fill'}{raised}"]
    for where in dict.fromkeys(source.values()):
        parts.append(f"{where}: {flags({k: getattr(cfg, k) for k, w in source.items() if w == where})}")
    fsdp = [k for k in recipe if k in FSDP_LEAVES and k not in source and cfg.fsdp]
    if fsdp:  # the recipe's Muon and EMA do not shard yet: the library defaults train in their place
        parts.append(f"--fsdp: {flags({k: getattr(cfg, k) for k in fsdp})} in place of the recipe's "
                     f"{flags({k: recipe[k] for k in fsdp})} ({FSDP_WHY})")  # fmt: skip
    left = [k for k in recipe if k not in source and k not in fill and k not in fsdp]
    if left:
        parts.append(f"default: {flags({k: getattr(cfg, k) for k in left})}")
    said = f"train: settings from {'; '.join(parts)} (--recipe off keeps the library defaults)"
    runtime.FILLED.update({k: "small-run recipe" for k in fill})
    runtime.FILLED.update({k: f"default (--fsdp: in place of the recipe's {recipe[k]})" for k in fsdp})
    if raised:
        runtime.FILLED["max_tokens"] = f"small-run recipe, raised for {world} ranks"
    return replace(cfg, **fill), said


# settings that may change on --resume without breaking exactness
_RESUME_FREE = {"resume", "progress", "tensorboard", "report_to", "project", "run_name", "checkpoint_every", "keep_checkpoints", "log_every",
                "val_every", "prefetch", "prefetch_depth", "tensor_parallel_size", "engine_args", "device", "max_steps", "target", "attention_chunk", "checkpoint_layer", "checkpoint_head", "trust_remote_code", "skip_bad", "allow_partial"}  # fmt: skip
