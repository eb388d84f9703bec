"""Draft quality per token of data: ShareGPT's replies vs the target's own, and 1 vs 3 epochs, in one run.

    python benchmarks/quality.py [--samples 120] [--max-length 256] [--reply-tokens 192] [--prompts 80]
                                 [--draft-vocab-size 8192] [--ttt-steps 3] [--lr 1e-3] [--max-tokens 1024]
                                 [--out DIR]

On the embedded default (SmolLM2-135M-Instruct), from the first `--samples` ShareGPT conversations whose first
user turn fits in `max_length - 64` tokens, each cut to its first user turn and reply:
  sharegpt      ShareGPT's own replies, 1 epoch
  regenerated   the same user turns with the target's greedy replies (`specdraft regenerate`), 1 epoch
  regen/3, 3ep  the first third of the regenerated conversations, 3 epochs
All three train the same number of optimizer steps (those of `regenerated`'s one epoch) with the same seed
and settings; each draft is exported and served by vLLM behind the target over the MT-bench first turns
(k=3, greedy, 64 new tokens), one engine after the other in this process, and vLLM's counters give tau and
acceptance per position. Prints one table (the rows are measured in the same run, side by side).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from specdraft.capture.extract import extract
from specdraft.data.prepare import MANIFEST_FILE, normalize, prepare, read_conversations, sharegpt_path
from specdraft.data.regenerate import regenerate, render
from specdraft.eval.serving import evaluate_vllm
from specdraft.export import export
from specdraft.targets import load_tokenizer
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train


def first_turns(out: Path, n: int, max_prompt_tokens: int) -> Path:
    """The first n usable ShareGPT conversations whose first user turn fits, cut to [system,] user, reply."""
    tok = load_tokenizer()
    rows = []
    for _, raw in read_conversations(sharegpt_path()):
        msgs, why = normalize(raw)
        if why:
            continue
        head = [m for m in msgs[:1] if m["role"] == "system"]
        user = next(m for m in msgs if m["role"] == "user")
        reply = next(m for m in msgs[msgs.index(user) :] if m["role"] == "assistant")
        if len(render(tok, [*head, user])) > max_prompt_tokens:
            continue
        rows.append({"messages": [*head, user, reply]})
        if len(rows) == n:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def arm(root: Path, name: str, convs: Path, a, steps: int, epochs: int) -> dict:
    """prepare -> extract -> train (`steps` steps, or one epoch when steps is 0) -> export; the arm's row."""
    ds = prepare(str(convs), str(root / f"ds_{name}"), max_length=a.max_length)
    hs = extract(str(ds), str(root / f"hs_{name}"), backend="hf", skip_doctor=True)
    cfg = TrainConfig(draft_vocab_size=a.draft_vocab_size, ttt_steps=a.ttt_steps, lr=a.lr, epochs=epochs,
                      max_steps=steps, max_tokens=a.max_tokens, max_length=a.max_length, val_fraction=0.0,
                      checkpoint_every=10**6, progress=False, tensorboard=False, seed=0, recipe="off")  # fmt: skip
    t0 = time.perf_counter()
    final = train(str(hs), str(root / f"train_{name}"), cfg)
    meta = json.loads((Path(final) / "config.json").read_text())["train"]
    man = json.loads((Path(ds) / MANIFEST_FILE).read_text())
    assert export(str(final), str(root / f"export_{name}"), format="speculators", k=3, check_vllm=False) == 0
    return {"arm": name, "conversations": man["num_samples"], "loss_tokens": man["num_loss_tokens"],
            "epochs": round(meta["steps"] / max(1, _steps_per_epoch(root / f"train_{name}")), 2),
            "steps": meta["steps"], "train_s": round(time.perf_counter() - t0, 1),
            "export": str(root / f"export_{name}")}  # fmt: skip


def _steps_per_epoch(run: Path) -> int:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if r["split"] == "train"][-1]
    return round(last["step"] / last["epoch"]) if last["epoch"] else 1


def serve_rows(rows: list[dict], prompts: int, out: Path, max_num_seqs: int = 16) -> dict:
    """Serve every row's export in vLLM behind the target over the MT-bench first turns (k=3, greedy, 64 new
    tokens, `max_num_seqs` decoded together) in one run; add tau, acceptance per position and the lossless
    verdict to each row; the report."""
    rep = evaluate_vllm([r["export"] for r in rows], prompts="mtbench", k=3, max_new_tokens=64,
                        max_prompts=prompts, out=str(out), max_num_seqs=max_num_seqs)  # fmt: skip
    for r in rows:
        r.update(served(rep["drafts"][r["export"]]))
        print(json.dumps(r), flush=True)
    return rep


def served(d: dict) -> dict:
    """A row's fields from one draft of a vLLM report: tau, acceptance per position, the lossless verdict."""
    acceptance = [None if x is None else round(x, 3) for x in d["acceptance_rate_per_position"]]
    return {"tau": round(d["tau"], 3), "acceptance": acceptance, "lossless": d["lossless"]["ok"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=120)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--reply-tokens", type=int, default=192)
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=1024, help="padded tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        share = first_turns(root / "sharegpt_first_turns.jsonl", a.samples, a.max_length - 64)
        regen = regenerate(str(share), str(root / "regenerated"), turns="first", max_new_tokens=a.reply_tokens,
                           max_prompt_tokens=a.max_length - 64)  # fmt: skip
        third = root / "regenerated_third.jsonl"
        lines = regen.read_text().splitlines(keepends=True)
        third.write_text("".join(lines[: len(lines) // 3]))
        rows = [arm(root, "regenerated", regen, a, 0, 1)]
        steps = rows[0]["steps"]
        rows.append(arm(root, "sharegpt", share, a, steps, 100))
        rows.append(arm(root, "regen_third_3ep", third, a, steps, 3))
        rep = serve_rows(rows, a.prompts, root / "eval")
    print(
        f"\n{'arm':<18}{'convs':>6}{'loss tok':>9}{'epochs':>7}{'steps':>6}{'vLLM tau':>9}  acceptance per position"
    )
    for r in rows:
        print(f"{r['arm']:<18}{r['conversations']:>6}{r['loss_tokens']:>9}{r['epochs']:>7}{r['steps']:>6}"
              f"{r['tau']:>9.3f}  {r['acceptance']}  lossless {r['lossless']}")  # fmt: skip
    print(
        f"(MT-bench first turns: {rep['settings']['prompts']}, k=3, greedy, 64 new tokens; vLLM {rep['vllm_version']})"
    )


if __name__ == "__main__":
    main()
