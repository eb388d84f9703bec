"""GPU-aware defaults (device and dtype `auto` everywhere) and the settings file each command writes."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdraft import runtime
from specdraft.runtime import resolve_device, resolve_dtype


@pytest.fixture
def gpu(monkeypatch):
    """CUDA available (mocked), with bf16 support; LOCAL_RANK unset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(runtime, "_warned", set())
    monkeypatch.setattr(runtime, "RESOLVED", {})


def test_auto_is_the_gpu_when_there_is_one(gpu, monkeypatch):
    assert resolve_device("auto") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")  # under torchrun: this process's GPU
    assert resolve_device("auto") == "cuda:3"
    assert resolve_dtype("auto", "cuda:3") == "bfloat16"
    assert runtime.RESOLVED == {"device": "cuda:3", "dtype": "bfloat16"}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda:0") == "float32"


def test_auto_is_the_cpu_in_fp32_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"  # what is given is kept


def test_bf16_is_native_on_a_bf16_gpu_and_on_a_cpu_with_avx512_bf16_or_amx(gpu, monkeypatch):
    assert runtime.bf16_native("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert not runtime.bf16_native("cuda:0")
    for avx512_bf16, amx, native in [(True, False, True), (False, True, True), (False, False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert runtime.bf16_native("cpu") is native
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the probe: emulated, no
    assert runtime.bf16_native("cpu") is False
    assert runtime.bf16_native("mps") is False


def test_a_cpu_run_on_a_gpu_machine_is_warned_once(gpu, capsys):
    assert resolve_device("cpu", "train") == "cpu"
    assert resolve_device("cpu", "train") == "cpu"
    err = capsys.readouterr().err
    assert err.count("warning: a GPU is present but this run is on the CPU") == 1
    assert err.startswith("train: ")


def test_every_command_defaults_to_auto():
    from specdraft.capture.extract import extract
    from specdraft.data.regenerate import regenerate
    from specdraft.eval.command import evaluate
    from specdraft.export import export
    from specdraft.quickstart import quickstart
    from specdraft.train.config import TrainConfig

    for fn, names in ((extract, ("device", "dtype")), (regenerate, ("device", "dtype")),
                      (evaluate, ("device", "dtype")), (export, ("dtype",)), (quickstart, ("device",))):  # fmt: skip
        params = inspect.signature(fn).parameters
        for n in names:
            assert params[n].default == "auto", (fn.__name__, n)
    cfg = TrainConfig()
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    assert cfg.problems() == []


def test_train_under_torchrun_takes_its_local_gpu(gpu, monkeypatch):
    """`--device auto` under torchrun (WORLD_SIZE > 1) joins NCCL on cuda:LOCAL_RANK, not gloo on the CPU."""
    from specdraft.train import distributed

    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda backend: calls.setdefault("backend", backend)
    )
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    rank, world, dev = distributed._init_distributed(resolve_device("auto", "train"))
    assert (rank, world, str(dev)) == (1, 2, "cuda:1")
    assert calls == {"set_device": 1, "backend": "nccl"}


def test_hashing_a_large_targets_weights_shows_its_progress(tmp_path, monkeypatch, capsys):
    """Over the size where hashing takes a while (minutes for a 1 TB target), a bar over the bytes hashed."""
    from safetensors.torch import save_file

    from specdraft import fileio

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fileio, "_LOUD_BYTES", 0)  # every size counts as large here
    d = tmp_path / "target"
    d.mkdir()
    for i in range(3):
        save_file({f"w{i}": torch.zeros(256)}, str(d / f"model-0000{i}-of-00003.safetensors"))
    fileio.weights_fingerprint(d, threads=2)
    err = capsys.readouterr().err
    assert "hashing weights" in err and "100%" in err
