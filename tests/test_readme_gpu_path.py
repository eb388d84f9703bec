"""Issue 48: the README's GPU path run as written, with the embedded default in place of Llama and 2 ranks on
CPU (gloo) in place of 8 GPUs, 6 conversations of at most 512 tokens: prepare -> extract (vLLM, fp8) -> torchrun
train -> export. Its torchrun line on
small data used to stop at "--max-tokens 512 cannot hold 2 samples of up to 2048 tokens" (once per rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.real, needs_vllm]

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_lines() -> list[str]:
    """The GPU section's command lines, as the README writes them."""
    text = README.read_text()
    block = text.split("**Your own model on one GPU node**", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("T=")]


def test_the_readme_gpu_path_runs_as_written(tmp_path):
    lines = _readme_lines()
    assert any(ln.startswith("torchrun") for ln in lines), lines
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    runs = tmp_path / "runs"
    for ln in lines:
        if ln.startswith(("pip ", "vllm serve")):
            continue  # the install and the server are not part of the pipeline's run here
        # the same commands, smaller: 6 conversations of at most 512 tokens (2048 on 2 CPU ranks: ~15 min)
        ln = ln.replace("$T", "smollm2-135m").replace("--max-samples 10000", "--max-samples 6")
        ln = ln.replace("--max-length 2048", "--max-length 512")
        ln = ln.replace("--nproc_per_node 8", "--nproc_per_node 2").replace("--verifier smollm2-135m",
                                                                            "--verifier HuggingFaceTB/SmolLM2-135M-Instruct")  # fmt: skip
        words = ln.split()
        if words[0] == "specdraft":
            cmd = [sys.executable, "-m", "specdraft.cli", *words[1:]]
        else:
            assert words[0] == "torchrun", ln
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{ln}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        if words[0] == "torchrun":
            assert r.stdout.count("raised from the recipe's 512") == 1  # said once, by rank 0
    final = json.loads((runs / "draft" / "final" / "config.json").read_text())
    assert final["train"]["steps"] > 0
    export = json.loads((runs / "export" / "config.json").read_text())
    assert export["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
