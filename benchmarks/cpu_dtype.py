"""float32 against bfloat16 on this machine's device, side by side: a matmul, extraction and training (issue 57's
"make extract use the cores": the quickstart extracts and trains in bf16 where `runtime.bf16_native` says so).

    python benchmarks/cpu_dtype.py DATASET SCRATCH [--samples 32] [--steps 60] [--device cpu]

DATASET: a prepared dataset (`specdraft prepare`, e.g. a quickstart's runs/quickstart/dataset). Its first
--samples conversations are extracted once in each dtype (SCRATCH/hs-float32, SCRATCH/hs-bfloat16), then the
quickstart's draft trains --steps optimizer steps on the fp32 extraction in each dtype. Prints GFLOP/s and
tokens/s for both and their ratios, and how far the bf16 extraction's hidden states are from the fp32 one's;
asserts nothing (wall-clock figures; run it on an otherwise idle machine). Whether the bf16 draft serves as well
is a tau question: docs/experiments.md, "bf16 on the CPU".
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch


def _matmul(dtype: torch.dtype, device: str) -> float:
    """GFLOP/s of a (2048, 576) x (576, 1536) matmul (SmolLM2's MLP at one extraction batch)."""
    a = torch.randn(2048, 576, dtype=dtype, device=device)
    b = torch.randn(576, 1536, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    n, t = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 2048 * 576 * 1536 / ((time.perf_counter() - t) / n) / 1e9


def _extract(dataset: str, out: Path, dtype: str, samples: int, device: str) -> float:
    """Tokens/s of extracting the first ``samples`` conversations in ``dtype`` (a fresh directory)."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import load_dataset

    shutil.rmtree(out, ignore_errors=True)
    ds = load_dataset(dataset)
    tokens = sum(len(ds.input_ids[i]) for i in range(min(samples, len(ds))))
    t = time.perf_counter()
    extract(dataset, str(out), device=device, dtype=dtype, max_samples=samples, samples_per_shard=16,
            max_tokens_per_batch=2048)  # fmt: skip
    return tokens / (time.perf_counter() - t)


def _train(shards: Path, out: Path, dtype: str, steps: int, device: str) -> float:
    """Tokens/s of the quickstart's draft training in ``dtype``: the median of its log's steps."""
    import json

    from specdraft.quickstart import BUDGETS
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    shutil.rmtree(out, ignore_errors=True)
    b = BUDGETS["default"]
    cfg = TrainConfig(draft_vocab_size=b.draft_vocab_size, ttt_steps=b.ttt_steps, epochs=1, lr=b.lr,
                      max_tokens=b.max_tokens, schedule=b.schedule, checkpoint_every=10**6, val_fraction=0.05,
                      val_every=10**6, device=device, recipe="off", dtype=dtype, max_steps=steps,
                      **b.train_recipe())  # fmt: skip
    train(str(shards), str(out), cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rates = sorted(r["tokens_per_s"] for r in rows if r.get("split") == "train" and r["step"] > 5)
    return rates[len(rates) // 2]  # the median step after the first 5 (allocation, first batches)


def _distance(a_dir: Path, b_dir: Path) -> tuple[float, float]:
    """Median relative L2 error and smallest cosine of b's hidden states against a's, over every token and layer."""
    from safetensors.torch import load_file

    rel, cos = [], []
    for f in sorted(a_dir.glob("shard-*.safetensors")):
        a, b = load_file(f), load_file(b_dir / f.name)
        for k, x in a.items():
            if k.endswith(".hidden"):
                x, y = x.float(), b[k].float()  # (T, L, H)
                rel.append((x - y).norm(dim=-1).flatten() / x.norm(dim=-1).flatten().clamp_min(1e-6))
                cos.append(torch.nn.functional.cosine_similarity(x, y, dim=-1).flatten())
    return torch.cat(rel).median().item(), torch.cat(cos).min().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset")
    ap.add_argument("scratch")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from specdraft.runtime import bf16_native

    root = Path(a.scratch)
    print(f"{a.device}: bf16 native {bf16_native(a.device)}, torch threads {torch.get_num_threads()}")
    res = {}
    for name, dt in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        res[name] = {
            "matmul GFLOP/s": _matmul(dt, a.device),
            "extract tok/s": _extract(a.dataset, root / f"hs-{name}", name, a.samples, a.device),
        }
    for name in ("float32", "bfloat16"):  # both on the fp32 extraction: the dtype of training alone
        res[name]["train tok/s"] = _train(
            root / "hs-float32", root / f"train-{name}", name, a.steps, a.device
        )
    print(f"{'':<16}{'float32':>10}{'bfloat16':>10}{'bf16/fp32':>11}")
    for k in res["float32"]:
        f, b = res["float32"][k], res["bfloat16"][k]
        print(f"{k:<16}{f:>10.1f}{b:>10.1f}{b / f:>10.2f}x")
    rel, cos = _distance(root / "hs-float32", root / "hs-bfloat16")
    print(f"bf16 extraction against fp32: median relative error {rel:.4f}, smallest cosine {cos:.4f} "
          "(both stored in bf16)")  # fmt: skip


if __name__ == "__main__":
    main()
