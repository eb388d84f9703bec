"""What a run is built from: the data (shards, or a dataset + the target online), draft, teacher, schedule.

Offline, the samples come from `specdraft extract` shards and the target is the one named in their
manifest (checked by config hash); online, from a `specdraft prepare` dataset, captured from the target
in this process or through a vLLM engine (under torchrun, rank 0's engine captures every rank's rows:
`batches.ScatteredSource`). Either way the draft vocabulary comes from the data's token counts. Offline, the shards
must be bound to their extraction, its dataset unchanged since, and no sample missing (`--allow-partial`
trains on what is there); the provenance records the extraction and dataset hashes that `--resume` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from specdraft.model.checkpoint import draft_dir, load_draft_config, load_trained
from specdraft.model.draft import Eagle3Draft, build_draft
from specdraft.runtime import resolve_dtype
from specdraft.train.batches import OnlineSource, ScatteredSource, ShardSource, split_sids
from specdraft.train.config import TrainConfig, with_recipe
from specdraft.train.ttt import TeacherHead


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
    embed_source: object = None  # where checkpoints find the frozen embedding (None: they keep a copy)
    cfg: TrainConfig | None = None  # the settings trained with (the recipe's where it applies: `with_recipe`)


@dataclass
class _Opened:
    """The data opened and its target loaded, before the draft exists."""

    source: object  # ShardSource or OnlineSource
    lengths: dict[int, int]  # sample id -> tokens
    counts: object  # token counts of the loss-masked tokens (picks the draft vocabulary)
    target: object  # the loaded target
    layer_ids: list[int]  # 3 aux layer ids + the final layer id
    provenance: dict
    scored: int  # loss-masked tokens of the samples used (offline: the dataset's share, estimated)


def _open_online(data: str, cfg: TrainConfig, device: torch.device, target_dtype: str) -> _Opened:
    """A prepared dataset and the target that captures its hidden states batch by batch: in this process
    (transformers), or through a vLLM engine (`--backend vllm`), with only the target's embeddings, final
    norm and lm_head loaded here for the teacher (`model.frozen`), as offline."""
    from specdraft.data.prepare import load_dataset

    ds = load_dataset(data)
    name = cfg.target or ds.manifest.get("target") or "smollm2-135m"
    n = min(len(ds), cfg.max_samples) if cfg.max_samples else len(ds)
    sids = list(range(n))
    lengths = {s: len(ds.input_ids[s]) for s in sids}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if cfg.backend == "vllm":
        max_len = min(max(lengths.values(), default=1), cfg.max_length)
        tgt, layer_ids, capture = _vllm_capture(name, cfg, device, target_dtype, max_len, engine=rank == 0)
    else:
        from specdraft.capture.hf import HFCapture
        from specdraft.targets import capture_layer_ids, load_target

        tgt = load_target(name, device=str(device), dtype=target_dtype, with_tokenizer=False,
                          trust_remote_code=cfg.trust_remote_code)  # fmt: skip
        layer_ids = capture_layer_ids(tgt.num_layers, cfg.layers)
        pad = tgt.model.config.get_text_config().pad_token_id
        capture = HFCapture(tgt, layer_ids, pad_id=pad if isinstance(pad, int) else 0)
    source = OnlineSource(ds, capture, cfg.max_length) if capture is not None else None
    if cfg.backend == "vllm" and world > 1:  # torchrun: rank 0's engine captures every rank's rows
        source = ScatteredSource(source, rank, world)
    prov = {"mode": "online", "backend": cfg.backend, "dataset": str(Path(data).resolve()), "layer_ids": layer_ids,
            "dataset_hash": ds.content_hash, "rendering": rendering_of(ds.manifest)}  # fmt: skip
    scored = sum(sum(ds.loss_mask[s]) for s in sids)
    return _Opened(source, lengths, ds.token_counts, tgt, layer_ids, prov, scored)


def _vllm_capture(name: str, cfg: TrainConfig, device: torch.device, dtype: str, max_len: int, engine: bool):
    """(the target's frozen parts, the layer ids, a vLLM capture engine of the target, or None without
    `engine`: ranks other than 0). The engine checks the options against the installed vLLM before anything
    loads; the frozen parts load after it."""
    from specdraft.capture.vllm import VLLMCapture
    from specdraft.engine.options import parse_engine_args
    from specdraft.engine.vllm_rpc import outside_torchrun
    from specdraft.model.frozen import load_frozen
    from specdraft.targets import capture_layer_ids, load_text_config, locate_target, tensor_parallel_problems

    for problem in tensor_parallel_problems(name, cfg.tensor_parallel_size, cfg.trust_remote_code):
        raise ValueError(f"train: {problem}")  # from the target's config, before the engine loads
    text_cfg = load_text_config(name, trust_remote_code=cfg.trust_remote_code)
    layer_ids = capture_layer_ids(text_cfg.num_hidden_layers, cfg.layers)
    if not engine:
        return (
            load_frozen(name, device=str(device), dtype=dtype, trust_remote_code=cfg.trust_remote_code),
            layer_ids,
            None,
        )
    local = locate_target(name, need="config")
    with outside_torchrun():  # under torchrun: the engine's processes are not trainer ranks
        cap = VLLMCapture(str(local) if local else name, layer_ids, dtype=dtype, max_model_len=max_len,
                          tensor_parallel_size=cfg.tensor_parallel_size, trust_remote_code=cfg.trust_remote_code,
                          engine_args=parse_engine_args(cfg.engine_args), seed=cfg.seed)  # fmt: skip
    try:
        tgt = load_frozen(name, device=str(device), dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except BaseException:
        cap.close()  # the engine's processes end with the failed setup
        raise
    return tgt, layer_ids, cap


def _open_offline(data: str, cfg: TrainConfig, device: torch.device, target_dtype: str) -> _Opened:
    """Extracted shards (several: comma-separated) and the parts of their target the teacher needs.

    Only the target's embeddings, final norm and lm_head are read (`model.frozen`), never its decoder
    layers; the target must be the one the shards came from (config hash and weights fingerprint).
    """
    from specdraft.data.store import ShardSet
    from specdraft.model.frozen import load_frozen

    ss = ShardSet.open([p for p in data.split(",") if p], skip_bad=cfg.skip_bad)
    counts = ss.token_counts()  # refused when the dataset was moved, deleted or changed since the extraction
    _check_complete(ss, data, cfg.allow_partial)
    man = ss.manifest
    layer_ids = list(man["layer_ids"])
    tinfo = man["target"]
    name = cfg.target or tinfo.get("path") or tinfo.get("name")
    if not cfg.target and tinfo.get("path") and not Path(tinfo["path"]).exists():
        name = tinfo.get("name")
    tgt = load_frozen(name, device=str(device), dtype=target_dtype, trust_remote_code=cfg.trust_remote_code)
    for what, ours, theirs in (("config hash", tgt.config_hash, tinfo.get("config_hash")),
                               ("weights fingerprint", tgt.weights_fingerprint, man.get("identity", {}).get("target_weights"))):  # fmt: skip
        if theirs and not str(theirs).startswith("hub:") and ours != theirs:
            raise ValueError(f"the target {name} ({what} {ours}) is not the one the shards were extracted from "
                             f"({tinfo.get('name')}, {what} {theirs}): its teacher head would be wrong; pass "
                             "--target with the extraction's model")  # fmt: skip
    sids = ss.sample_ids()
    if cfg.max_samples:
        sids = sids[: cfg.max_samples]
    lengths = {s: ss.length(s) for s in sids}
    dm = _dataset_manifest(man.get("dataset"))
    prov = {"mode": "offline", "shards": data, "layer_ids": layer_ids, "dataset_hash": man["dataset_hash"],
            "extraction": sorted(m["extraction_id"] for m in ss.manifests), "rendering": rendering_of(dm)}  # fmt: skip
    scored = int(counts.sum())  # the whole dataset's; the share of it these samples hold, where recorded
    if dm.get("num_tokens") and "num_loss_tokens" in dm:
        scored = round(dm["num_loss_tokens"] * min(1.0, sum(lengths.values()) / dm["num_tokens"]))
    return _Opened(ShardSource(ss), lengths, counts, tgt, layer_ids, prov, scored)


def _dataset_manifest(path: str | None) -> dict:
    """The manifest of the dataset an extraction was made from ({} when it cannot be read)."""
    import json

    try:
        return json.loads((Path(path) / "manifest.json").read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def rendering_of(dataset_manifest: dict) -> dict:
    """How the training data was rendered (chat or text mode, chat template hash, template kwargs): recorded
    in the draft, so eval can refuse to render its prompts otherwise."""
    keys = ("mode", "chat_template_sha256", "chat_template_kwargs")
    return {k: dataset_manifest[k] for k in keys if k in dataset_manifest}


def _check_complete(ss, data: str, allow_partial: bool) -> None:
    """Refuse an extraction that lacks samples (processes of --num-shards absent, shards not written yet or
    lost) unless `allow_partial`; then say how many are missing."""
    missing = ss.missing_samples()
    if not missing:
        return
    man = ss.manifest
    why = []
    if ss.absent_processes():
        why.append(f"no output of processes {ss.absent_processes()} of --num-shards {man['num_shards']}")
    unfinished = sorted(m["shard_index"] for m in ss.manifests if not m.get("complete"))
    if unfinished:
        why.append(f"process(es) {unfinished} not finished")
    n, have = man["num_samples"], len(ss.sample_ids())
    what = f"{data} lacks {len(missing)} of the extraction's {n} samples ({'; '.join(why) or 'shards lost'})"
    if not allow_partial:
        raise ValueError(f"train: {what}: finish the extraction (rerun `specdraft extract`; `specdraft verify` "
                         f"lists what is missing) and pass every process's directory, or pass --allow-partial to "
                         f"train on the {have} there")  # fmt: skip
    print(f"train: warning: --allow-partial: {what}; training on the {have} there", flush=True)


def _setup(data: str, cfg: TrainConfig, device: torch.device) -> _Setup:
    """Open the data (shards or, online, a dataset + the target), build the draft and the teacher head."""
    target_dtype = "bfloat16" if resolve_dtype(cfg.dtype, str(device)) == "bfloat16" else "float32"
    opened = (_open_online if cfg.online else _open_offline)(data, cfg, device, target_dtype)
    tgt, layer_ids, prov = opened.target, opened.layer_ids, opened.provenance
    world = dist.get_world_size() if dist.is_initialized() else 1
    longest = min(max(opened.lengths.values(), default=0), cfg.max_length)
    cfg, said = with_recipe(cfg, opened.scored, world=world, longest=longest)
    if said and (not dist.is_initialized() or dist.get_rank() == 0):
        print(said, flush=True)
    if len(layer_ids) != 4:
        raise ValueError(f"EAGLE-3 needs 3 aux layers + the final layer; the data has layer ids {layer_ids}")
    lengths = {s: min(n, cfg.max_length) for s, n in opened.lengths.items() if n >= 3}
    train_sids, val_sids = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    if (
        cfg.init_from
    ):  # a trained draft: its weights and vocabulary (not the data's counts), its sizes recorded
        draft, prov["init_from"] = warm_draft(cfg.init_from, tgt, layer_ids[:3])
        dc = draft.cfg
        cfg = replace(cfg, draft_vocab_size=dc.draft_vocab_size, norm_before_residual=dc.norm_before_residual,
                      fc_norm=dc.fc_norm, norm_output=dc.norm_output, draft_layers=dc.num_hidden_layers)  # fmt: skip
    else:
        draft = build_draft(tgt, opened.counts, layer_ids[:3], cfg.draft_vocab_size, cfg.norm_before_residual,
                            cfg.init_lm_head, seed=cfg.seed, fc_init=cfg.fc_init, num_hidden_layers=cfg.draft_layers,
                            fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)  # fmt: skip
    teacher = TeacherHead(tgt, draft.t2d).to(device)
    prov.update({"target": getattr(tgt, "path", "") or tgt.name, "target_config_hash": tgt.config_hash})
    embed = getattr(tgt, "embed_source", None)  # offline: checkpoints reference the target's embedding
    return _Setup(opened.source, lengths, train_sids, val_sids, draft.to(device), teacher, prov, embed, cfg)


def data_target(data: str, cfg: TrainConfig) -> tuple[str, str, list[int]] | None:
    """(name, config hash, layer ids) of the target the data is for, from metadata alone (the extraction's
    manifest; online the dataset's target's config); None when unreadable (opening the data says why)."""
    import json

    from specdraft.targets import EMBEDDED_DEFAULT, capture_layer_ids, config_hash, load_text_config

    try:
        if not cfg.online:
            first = Path(next(p for p in data.split(",") if p))
            man = json.loads(sorted(first.glob("manifest-*-of-*.json"))[0].read_text())
            return man["target"].get("name", ""), man["target"]["config_hash"], list(man["layer_ids"])
        name = (
            cfg.target
            or json.loads((Path(data) / "manifest.json").read_text()).get("target")
            or EMBEDDED_DEFAULT
        )
        text = load_text_config(name, trust_remote_code=cfg.trust_remote_code)
        return name, config_hash(text), capture_layer_ids(text.num_hidden_layers, cfg.layers)
    except (OSError, ValueError, KeyError, IndexError, TypeError, StopIteration):
        return None


def warm_problems(data: str, cfg: TrainConfig) -> list[str]:
    """--init-from a draft the data's target or layers cannot feed, each with its fix: metadata only, before
    anything loads (`init_problems` names a path without a draft)."""
    p = draft_dir(cfg.init_from) if cfg.init_from else None
    got = data_target(data, cfg) if p is not None else None
    if got is None:
        return []
    try:
        dc = load_draft_config(p)
    except (OSError, ValueError):
        return []
    return _mismatch(p, dc, *got, online=cfg.online)


def _mismatch(p: Path, dc, name: str, chash: str, layer_ids: list[int], online: bool) -> list[str]:
    """Why draft `p` (config `dc`) cannot start from the data's target `name` (config hash `chash`) and layers."""
    if dc.target_config_hash and chash and dc.target_config_hash != chash:
        return [f"--init-from {p} is a draft for another target ({dc.target_name or '?'}, config hash "
                f"{dc.target_config_hash}) than the data's ({name}, config hash {chash}): pass --init-from a draft "
                f"trained for {name}, or drop --init-from to start a fresh draft"]  # fmt: skip
    aux, have = list(dc.aux_layer_ids), list(layer_ids[:3])
    if (
        not aux and len(layer_ids) > 3 and layer_ids[3]
    ):  # a published draft that records none reads EAGLE-3's default ids
        from specdraft.targets import default_aux_layer_ids

        aux = default_aux_layer_ids(layer_ids[3])
    if aux != have:
        spelled = " ".join(map(str, aux))
        fix = (
            f"pass --layers {spelled}"
            if online
            else f"extract the data again with --layers {spelled} (into a new OUT)"
        )
        return [f"--init-from {p} reads aux layers {aux}, the data holds {have}: {fix}"]
    return []


def warm_draft(path: str, target, aux_layer_ids: list[int]) -> tuple[Eagle3Draft, str]:
    """The --init-from draft for this target and these aux layers (float32, embeddings frozen), and its path."""
    p = draft_dir(path)
    assert p is not None, "init_problems vets the path before setup"
    dc = load_draft_config(p)
    name = getattr(target, "path", "") or getattr(target, "name", "")
    errs = _mismatch(
        p, dc, name, target.config_hash, [*aux_layer_ids, getattr(target, "num_layers", 0)], online=False
    )
    if dc.hidden_size != target.hidden_size or dc.vocab_size != target.vocab_size:
        errs.append(f"--init-from {p}: its sizes (hidden {dc.hidden_size}, vocab {dc.vocab_size}) are not the target's "
                    f"(hidden {target.hidden_size}, vocab {target.vocab_size})")  # fmt: skip
    if errs:
        raise ValueError("train: " + "; ".join(errs))
    return load_trained(p, target=target), str(p)


def _lr_lambda(cfg: TrainConfig, total: int):
    """The learning-rate factor of each step: linear warmup, then cosine, linear or constant decay, or (wsd)
    constant then linear over the last `cooldown_ratio` of the steps."""
    warm = int(round(cfg.warmup_ratio * total))
    cool = max(1, int(round(cfg.cooldown_ratio * total)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant" or (cfg.schedule == "wsd" and step < total - cool):
            return 1.0
        if cfg.schedule == "wsd":
            frac = (step - (total - cool)) / cool
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * (1 - frac)
        frac = min(1.0, (step - warm) / max(1, total - warm))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return f


def planned(data: str | None, cfg: TrainConfig) -> tuple[TrainConfig, str]:
    """The settings a run of `cfg` on `data` would train with (its --loss resolved, the recipe filled from the
    data's metadata alone, for the ranks of this torchrun), and the recipe's line ("" where it does not apply or
    the data cannot be read here: the run itself then says why). What `--print-config` shows."""
    import os

    from specdraft.train.config import DFLASH_SMALL_RUN, with_own_loss

    cfg = with_own_loss(cfg)
    if not data:
        return cfg, ""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if cfg.online:
            from specdraft.data.prepare import load_dataset

            ds = load_dataset(data)
            sids = range(min(len(ds), cfg.max_samples) if cfg.max_samples else len(ds))
            lengths = [len(ds.input_ids[s]) for s in sids]
            scored = sum(sum(ds.loss_mask[s]) for s in sids)
        else:
            from specdraft.data.store import ShardSet

            ss = ShardSet.open([p for p in data.split(",") if p])
            sids = ss.sample_ids()[: cfg.max_samples or None]
            lengths = [ss.length(s) for s in sids]
            dm = _dataset_manifest(ss.manifest.get("dataset"))
            scored = int(ss.token_counts().sum())
            if dm.get("num_tokens") and "num_loss_tokens" in dm:
                scored = round(dm["num_loss_tokens"] * min(1.0, sum(lengths) / dm["num_tokens"]))
    except (OSError, ValueError, KeyError, TypeError):
        return cfg, ""
    longest = min(max(lengths, default=0), cfg.max_length)
    if cfg.draft == "dflash":
        recipe = {k: v for k, v in DFLASH_SMALL_RUN.items() if not (cfg.init_from and k == "block_size")}
        return with_recipe(cfg, scored, recipe)
    return with_recipe(cfg, scored, world=world, longest=longest)
