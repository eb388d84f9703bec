"""Issue 61 item 9: benchmarks/gpu_check.sh, the README's GPU path on one CUDA GPU, in its CPU dry-run mode: every
stage's command is checked by that command's own --print-config, and the table computes its figures from the
files a run leaves (here written by hand, with known numbers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def _dry_run(work: Path, **env) -> subprocess.CompletedProcess:
    src = str(SCRIPT.parents[1] / "src")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", str(work)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_the_dry_run_checks_every_stage_and_prints_the_table(tmp_path):
    work = tmp_path / "gc"
    (work / "ds").mkdir(parents=True)
    (work / "eval").mkdir()
    (work / "stages.tsv").write_text("prepare\t2.0\t0\t0\nextract\t4.0\t10240\t0\n")
    (work / "ds" / "manifest.json").write_text(json.dumps({"num_tokens": 1000}))
    report = {
        "drafts": {
            "x": {
                "tau": 1.5,
                "speedup": 1.25,
                "tokens_per_s": 1234.5,
                "batch1": {"speedup": 1.1},
                "lossless": {"ok": True},
            }
        }  # fmt: skip
    }
    (work / "eval" / "report_vllm.json").write_text(json.dumps(report))  # what eval --engine vllm writes
    (work / "eval_t07").mkdir()
    sampled = {"drafts": {"x": {"tau": 1.25, "speedup": 0.9, "distribution": {"ok": False}}}}
    (work / "eval_t07" / "report_vllm.json").write_text(json.dumps(sampled))
    r = _dry_run(work)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for stage in ("prepare", "extract", "train", "export", "eval", "eval_t07", "doctor"):
        assert f"== {stage}: " in r.stdout
    assert "--backend vllm --store-dtype fp8" in r.stdout and "--dtype bfloat16" in r.stdout
    assert "--engine vllm" in r.stdout and "--batch1-prompts 8" in r.stdout and "--live" in r.stdout
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.split()}
    assert rows["prepare"][1:3] == ["2.0", "500"] and rows["extract"][1:3] == ["4.0", "250"]
    assert rows["extract"][-2:] == ["10,240", "0"] and rows["eval"][1:3] == ["-", "1,234"]
    assert "tau (vLLM, MT-bench first turns)  1.500" in r.stdout and "speed-up at batch 1  x1.10" in r.stdout
    assert "--temperature 0.7 --draft-sample probabilistic --dist-samples 200" in r.stdout
    assert re.search(r"tau at T=0.7 \(probabilistic drafting\) +1.250", r.stdout)
    assert re.search(r"distribution kept at T=0.7 +False", r.stdout)


def test_a_stage_command_the_cli_refuses_fails_the_dry_run(tmp_path):
    """The check can fail: a sample count the prepare command refuses stops the dry run, naming why."""
    r = _dry_run(tmp_path / "gc", GPU_CHECK_SAMPLES="many")
    assert r.returncode != 0 and "--max-samples" in r.stderr
