"""Does vLLM run OUR draft? Two checks of the served draft against specdraft's own.

:func:`drafter_parity` recomputes, with our :class:`~specdraft.model.draft.Eagle3Draft`, every call vLLM
made to the draft it loaded (recorded inside the worker by :mod:`specdraft.eval.vllm_worker`) and reports
how far the outputs are apart. :func:`compare_with_reference` puts the figures of a vLLM evaluation next
to the reference decoder's for the same draft, prompts and k, down to the accepted count of every round.
"""

from __future__ import annotations

from typing import Any

import torch

from specdraft.eval.stats import first_divergence


def _match_rows(rows: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Index into ``pool`` (N, H) of each row of ``rows`` (S, H), and the worst match distance."""
    dist = (pool[None, :, :] - rows[:, None, :]).abs().amax(-1)  # (S, N)
    best, idx = dist.min(dim=1)
    return idx, float(best.max()) if best.numel() else 0.0


class _Replay:
    """Our draft fed the inputs vLLM gave its draft, event by event, with the largest differences so far."""

    def __init__(self, draft: Any):
        from specdraft.model.draft import DraftKVCache

        self.draft = draft
        p = next(draft.parameters())
        self.dev, self.dt = p.device, p.dtype
        self.cache = DraftKVCache()
        self.fused: torch.Tensor | None = None  # our fused input, waiting for its first pass
        self.prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = (
            None  # vllm prenorm, ours, vllm normed
        )
        self.worst = {"fc": 0.0, "hidden": 0.0, "logits": 0.0}
        self.scales = {"fc": 0.0, "hidden": 0.0, "logits": 0.0}
        self.rows = self.agree = self.first_passes = self.chain_steps = 0
        self.match_err = 0.0

    def _note(self, what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        self.worst[what] = max(self.worst[what], float((ours.float().cpu() - theirs.float()).abs().max()))
        self.scales[what] = max(self.scales[what], float(theirs.float().abs().max()))

    def _match(self, rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        idx, err = _match_rows(rows.float(), pool.float())
        self.match_err = max(self.match_err, err)
        return idx

    def fc(self, ev: dict[str, Any]) -> None:
        """A first pass is coming: fuse the 3H aux states vLLM fused."""
        self.fused = self.draft.fuse(ev["aux"].to(self.dev, self.dt))  # (N, H)
        self._note("fc", self.fused, ev["out"])

    def model(self, ev: dict[str, Any]) -> None:
        """A draft forward: after ``fc`` a first pass on our fused input, else a chain step on our own output."""
        ids, pos = ev["input_ids"].long(), ev["positions"].long()
        if pos.dim() != 1 or not torch.equal(pos, pos[0] + torch.arange(pos.numel())):
            raise ValueError(
                "a drafter call holds several requests (positions are not one contiguous run): capture "
                "one prompt at a time for the parity check"
            )
        if self.fused is not None:
            hidden, self.fused = self.fused, None
            self.first_passes += 1
        else:
            if self.prev is None:
                raise ValueError("the capture starts with a chain step: start it before the request")
            hidden = self.prev[1][self._match(ev["hidden"], self.prev[0])]
            self.chain_steps += 1
        p0 = int(pos[0])
        if p0 > len(self.cache):
            raise ValueError(f"a drafter call starts at position {p0} but only {len(self.cache)} are known")
        self.cache.crop(p0)
        out, _ = self.draft(ids.to(self.dev)[None], hidden.to(self.dev, self.dt)[None], pos.to(self.dev)[None],
                            None, self.cache, compute_logits=False)  # fmt: skip
        out = out[0]  # (N, H)
        self._note("hidden", out, ev["prenorm"])
        self.prev = (ev["prenorm"], out, ev["normed"])

    def logits(self, ev: dict[str, Any]) -> None:
        """Logits at the rows vLLM picked (matched among its normed outputs), from our pre-norm output."""
        if self.prev is None:
            raise ValueError("logits recorded before any drafter call")
        idx = self._match(ev["hidden"], self.prev[2])
        ours = self.draft.compute_logits(self.prev[1][idx][None])[0].float().cpu()  # (S, Vd)
        theirs = ev["logits"].float()
        if ours.shape != theirs.shape:
            raise ValueError(f"our logits {tuple(ours.shape)} vs vLLM's {tuple(theirs.shape)}: vocab differs")
        self._note("logits", ours, theirs)
        self.rows += ours.shape[0]
        self.agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())


@torch.inference_mode()
def drafter_parity(draft: Any, capture: dict[str, Any]) -> dict[str, Any]:
    """Recompute every call vLLM made to its loaded draft with our ``Eagle3Draft``, from the raw inputs.

    ``capture`` comes from :meth:`~specdraft.eval.vllm_engine.VLLMEngine.pop_drafter_capture` for ONE
    request. A first pass (a model call preceded by ``fc``) is recomputed from the 3H aux states with our
    ``fuse``; a chain step from our own output of the previous call at the row vLLM fed back. Our draft
    keeps its own KV cache, cropped to the first position of each call, which is what vLLM's slot
    overwrites amount to (rejected positions are written over by the next call).

    Returns the number of calls, the largest absolute differences of the fused input (``fc``), the
    pre-norm hidden output (``hidden``) and the logits over the draft vocabulary (``logits``), the
    largest magnitude of each in vLLM's values (``scale``, for relative tolerances), the share of logit
    rows with the same argmax (``top1_agreement``), the worst distance of a row vLLM fed back to the
    row it was matched to (``row_match_error``) and whether vLLM's d2t equals ours (``d2t_equal``; None
    for a full vocabulary).

    Raises:
        ValueError: the capture holds several requests in one call, or a call starts beyond the context.
    """
    replay = _Replay(draft.eval())
    steps = {"fc": replay.fc, "model": replay.model, "logits": replay.logits}
    for ev in capture["events"]:
        step = steps.get(ev["kind"])
        if step is not None:
            step(ev)
    d2t = capture.get("d2t")
    ours_full = draft.cfg.draft_vocab_size == draft.cfg.vocab_size
    d2t_equal = (
        None
        if d2t is None and ours_full
        else bool(d2t is not None and torch.equal(d2t.cpu(), draft.d2t.cpu()))
    )
    return {
        "first_passes": replay.first_passes,
        "chain_steps": replay.chain_steps,
        "logit_rows": replay.rows,
        "max_abs_diff": replay.worst,
        "scale": replay.scales,
        "top1_agreement": replay.agree / replay.rows if replay.rows else None,
        "row_match_error": replay.match_err,
        "d2t_equal": d2t_equal,
    }


def compare_with_reference(vllm_report: dict, name: str, ref_report: dict, ref_name: str) -> dict:
    """vLLM's figures for draft ``name`` next to the reference decoder's for ``ref_name``.

    Returns tau and per-position acceptance of both with their differences, and, when vLLM recorded
    per-request rounds, how many prompts have the same accepted count in every round and where the
    first difference is.
    """
    v = vllm_report["drafts"][name]
    r = ref_report["drafts"][ref_name]
    pv, pr = v["acceptance_rate_per_position"], r["acceptance_rate_per_position"]
    diffs = [None if a is None or b is None else round(a - b, 6) for a, b in zip(pv, pr)]
    out: dict[str, Any] = {
        "draft": ref_name,
        "tau": r["tau"],
        "tau_diff": round(v["tau"] - r["tau"], 6),
        "rounds": r["rounds"],
        "acceptance_rate_per_position": pr,
        "acceptance_rate_per_position_diff": diffs,
        "reached_per_position": r["reached_per_position"],
        "lossless_ok": r["lossless"]["ok"],
    }
    ref_rounds = {
        (str(rec["id"]), rec["turn"]): rec["drafts"][ref_name]["accepted"] for rec in ref_report["records"]
    }
    same, compared, first = 0, 0, []
    for rec in vllm_report["records"]:
        mine = rec["drafts"][name].get("accepted")
        theirs = ref_rounds.get((str(rec["id"]), rec["turn"]))
        if mine is None or theirs is None:
            continue
        compared += 1
        at = first_divergence(mine, theirs)
        if at is None:
            same += 1
        else:
            first.append({"id": rec["id"], "turn": rec["turn"], "round": at, "vllm": mine[at : at + 4],
                          "reference": theirs[at : at + 4]})  # fmt: skip
    out["prompts_compared"] = compared
    out["prompts_with_identical_rounds"] = same
    out["first_round_differences"] = first
    return out
