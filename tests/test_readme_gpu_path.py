"""Issue 48: the README's GPU path run as written, with the embedded default in place of Llama and 2 ranks on
CPU (gloo) in place of 8 GPUs, 6 conversations of at most 512 tokens: prepare -> extract (vLLM, fp8) -> torchrun
train -> export. Its torchrun line on
small data used to stop at "--max-tokens 512 cannot hold 2 samples of up to 2048 tokens" (once per rank)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_vllm
from test_train_distributed import ctrl_c_resume_line

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.real, needs_vllm]

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_lines() -> list[str]:
    """The GPU section's command lines, as the README writes them."""
    text = README.read_text()
    block = text.split("**Your own model on one GPU node**", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("T=")]


def _torchrun_cmd(words: list[str]) -> list[str]:
    """A README torchrun line's words as run here: torch's module, a standalone rendezvous on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]


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
            # issue 61: Ctrl-C after its step-2 checkpoint (kept every 2 steps here) prints the resume line once,
            # the torchrun line it started with; that line, as printed, finishes the run
            line, stdout = ctrl_c_resume_line(_torchrun_cmd([*words, "--checkpoint-every", "2"]), runs / "draft",
                                              env, cwd=tmp_path)  # fmt: skip
            assert stdout.count("raised from the recipe's 512") == 1  # said once, by rank 0
            words = shlex.split(line)
            assert " ".join(words[:5]) == "torchrun --nproc_per_node 2 -m specdraft.cli", words
            cmd = _torchrun_cmd(words)
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{ln}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        if words[0] == "torchrun":
            assert r.stdout.count("train: resuming from ") == 1  # said by rank 0
    final = json.loads((runs / "draft" / "final" / "config.json").read_text())
    assert final["train"]["steps"] > 0
    export = json.loads((runs / "export" / "config.json").read_text())
    assert export["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
