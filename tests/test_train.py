"""Training-time test and the trainer: mask spec, brute-force TTT step, zero loss for a copying draft, teacher
head, offline == online, exact resume, non-finite stop, user errors. Tiny random Llama (hidden 64, 8 layers)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import StubDraft, conversations, stub_unroll, write_jsonl

import specdraft.train.batches as batches
import specdraft.train.loop as loop
import specdraft.train.setup as setup
import specdraft.train.ttt as ttt
from specdraft.model.checkpoint import STATE_FILE, latest_checkpoint, load_draft
from specdraft.model.draft import DraftKVCache, build_draft
from specdraft.train.config import TrainConfig
from specdraft.train.loop import NonFiniteError, train
from specdraft.train.ttt import TeacherHead, TTTModel, step_token_counts, ttt_unroll


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_llama_dir):
    """(dataset dir, shards dir) made by the real prepare + extract on the tiny Llama."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("train-data")
    src = write_jsonl(d / "c.jsonl", conversations(48, seed=1))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=128)
    shards = extract(str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=16,
                     max_tokens_per_batch=512, skip_doctor=True, store_dtype="float32")  # fmt: skip
    return ds, shards


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    from specdraft.targets import load_target

    return load_target(str(tiny_llama_dir), with_tokenizer=False)


def cfg(**kw) -> TrainConfig:
    base = dict(draft_vocab_size=128, ttt_steps=3, max_tokens=1024, max_length=128, epochs=2, lr=3e-3,
                warmup_ratio=0.1, val_fraction=0.1, checkpoint_every=2, progress=False, tensorboard=False)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def draft_of(target, vd=128, seed=0):
    counts = torch.ones(target.vocab_size)
    counts[:50] = 10
    return build_draft(target, counts.numpy(), [2, 4, 5], draft_vocab_size=vd, seed=seed)


# ---------------------------------------------------------------------------------------------------------
# the TTT attention mask and unroll
# ---------------------------------------------------------------------------------------------------------


def test_ttt_step_equals_brute_force_inference(target):
    """Every TTT step's output at every slot equals running the draft as speculative decoding does (the
    attention chunked 3 query rows at a time, so the chunk seams are crossed too)."""
    draft = draft_of(target)
    with torch.no_grad():
        for p in draft.midlayer.parameters():  # larger weights so attention mixing is visible
            p.mul_(3)
    g = torch.Generator().manual_seed(0)
    B, n, K, H = 2, 7, 4, target.hidden_size
    ids = torch.randint(0, target.vocab_size, (B, n), generator=g)
    aux = torch.randn(B, n, 3 * H, generator=g)
    with torch.no_grad():
        steps = list(ttt_unroll(draft, ids, aux, K, chunk_elems=3 * B * draft.cfg.num_attention_heads * n))
        for t in range(n - 1):
            # step 0 over the prefix 0..t (tokens x_1..x_{t+1}, features f_0..f_t): a plain causal prefill
            cache = DraftKVCache()
            fused = draft.fuse(aux[:, : t + 1])
            pos = torch.arange(t + 1)[None].expand(B, -1)
            h, _ = draft(ids[:, 1 : t + 2], fused, pos, kv_cache=cache)
            torch.testing.assert_close(h[:, t], steps[0][:, t], atol=1e-5, rtol=1e-5)
            h = h[:, t : t + 1]
            for i in range(1, K):  # then one token a step, attending to the whole cache, no mask
                if t + 1 + i >= n:
                    break
                h, _ = draft(ids[:, t + 1 + i : t + 2 + i], h, torch.full((B, 1), t + i), kv_cache=cache)
                torch.testing.assert_close(h[:, 0], steps[i][:, t], atol=1e-5, rtol=1e-5)
                assert len(cache) == t + 1 + i


def dense_teacher(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, Vd) log-probs -> the compact teacher `TTTModel` takes, computed at every position:
    p (B T, Vd), negent (B T,), row (B, T)."""
    B, T = logp.shape[:2]
    p = logp.exp().flatten(0, 1)  # (B T, Vd)
    return p, (p * logp.flatten(0, 1)).sum(-1), torch.arange(B * T).view(B, T)


def test_loss_is_zero_for_a_draft_that_copies_the_teacher(monkeypatch):
    monkeypatch.setattr(ttt, "ttt_unroll", stub_unroll)
    g = torch.Generator().manual_seed(0)
    B, n, Vd, K = 2, 12, 50, 5
    logits = 3 * torch.randn(B, n, Vd, generator=g)
    logp = F.log_softmax(logits, -1)
    top = logits.argmax(-1)  # every target argmax inside the draft vocabulary
    mask = torch.ones(B, n)
    mask[0, 9:] = 0
    counts = step_token_counts(mask, K)
    ids, aux = torch.zeros(B, n, dtype=torch.long), torch.zeros(B, n, 3)
    for ck in (False, True):
        m = TTTModel(StubDraft(logits), K, 0.8, checkpoint_head=ck)
        p, negent, row = dense_teacher(logp)
        loss, kl, agree = m(ids, aux, p, negent, top, row, mask, mask, counts)
        assert float(loss) < 1e-5 and torch.all(kl.abs() < 1e-4)
        torch.testing.assert_close(agree, counts)  # top-1 agrees on every masked token of every step
    wrong = TTTModel(StubDraft(logits, shift=2), K, 0.8)  # off by one position: clearly not zero
    loss, _, agree = wrong(
        ids, aux, *dense_teacher(logp)[:2], top, dense_teacher(logp)[2], mask, mask, counts
    )
    assert float(loss) > 1.0 and float(agree.sum()) < 0.5 * float(counts.sum())


def test_counts_and_masks_follow_the_predicted_token():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.float)
    # step i, slot t predicts token t+2+i: its loss mask is mask[t+2+i]
    assert step_token_counts(mask, 4).tolist() == [3.0, 2.0, 1.0, 1.0]


def test_teacher_head_equals_target_logits_restricted(target):
    draft = draft_of(target)
    z = torch.randn(2, 5, target.hidden_size)
    want = target.logits_from_final(z)[..., draft.t2d]
    logits, top = TeacherHead(target, draft.t2d, chunk_elems=3 * target.vocab_size)(z)  # 3 tokens a chunk
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    full = target.logits_from_final(z).argmax(-1)  # (2, 5) target ids
    index = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft index
    assert torch.equal(top, torch.where(draft.t2d[full], index[full], -1))


def test_teacher_draft_logits_are_its_forwards_to_the_bit(target):
    """`draft_logits` (lm_head's t2d rows alone: what a later epoch computes) is `forward`'s first output."""
    teacher = TeacherHead(target, draft_of(target).t2d, chunk_elems=3 * target.vocab_size)
    z = torch.randn(3, 7, target.hidden_size)
    assert torch.equal(teacher.draft_logits(z), teacher(z)[0])
    assert teacher.draft_logits(z[:0]).shape == (0, 7, teacher.draft_vocab_size)


# ---------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spb", [1, 2])
def test_a_later_epoch_reuses_each_samples_teacher_argmax_and_trains_the_same(
    tmp_path, data, monkeypatch, spb
):
    """The teacher's full-vocabulary argmax (its costly lm_head product) is computed once a sample: epoch 2 and
    the validations after the first compute the draft-vocabulary logits only (ttt.TopCache). The weights and
    every record equal those of a run that computes the full teacher every time."""
    _, shards = data
    c = cfg(epochs=2, steps_per_batch=spb, val_every=2)
    full_calls: list[int] = []
    forward = TeacherHead.forward
    monkeypatch.setattr(TeacherHead, "forward", lambda self, z: full_calls.append(len(z)) or forward(self, z))
    at_step: dict[int, int] = {}
    monkeypatch.setattr(loop, "_after_step", lambda step: at_step.__setitem__(step, len(full_calls)))
    kept = train(str(shards), str(tmp_path / "kept"), c)
    n_kept = len(full_calls)
    per_epoch = max(at_step) // 2
    assert at_step[max(at_step)] == at_step[per_epoch]  # epoch 2 (and its validations): no full product
    monkeypatch.setattr(loop, "TopCache", lambda: None)  # the teacher computed in full every time
    full_calls.clear()
    plain = train(str(shards), str(tmp_path / "plain"), c)
    assert n_kept < len(full_calls)
    a, b = load_draft(kept).state_dict(), load_draft(plain).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ma, mb = metrics(tmp_path / "kept"), metrics(tmp_path / "plain")
    assert [(r["step"], r["loss"], r["acc"]) for r in ma] == [(r["step"], r["loss"], r["acc"]) for r in mb]


def test_train_offline_learns_and_writes_outputs(tmp_path, data):
    _, shards = data
    out = tmp_path / "run"
    final = train(str(shards), str(out), cfg(epochs=3))
    rec = metrics(out)
    val = [r for r in rec if r["split"] == "val"]
    tr = [r for r in rec if r["split"] == "train"]
    assert val[0]["step"] == 0 and val[-1]["step"] == tr[-1]["step"]
    assert val[-1]["loss"] < 0.8 * val[0]["loss"], (val[0], val[-1])
    assert val[-1]["acc"][0] > val[0]["acc"][0]
    assert len(tr[-1]["acc"]) == 3 and tr[-1]["tokens_per_s"] > 0 and 0 <= tr[-1]["data_share"] <= 1
    assert len(tr[-1]["oov_share"]) == 3 and all(0 <= x <= 1 for r in rec for x in r["oov_share"])
    d = load_draft(final)
    assert d.cfg.aux_layer_ids == [2, 4, 5] and d.cfg.draft_vocab_size == 128
    meta = json.loads((final / "config.json").read_text())
    assert meta["train"]["steps"] == tr[-1]["step"] and meta["train"]["mode"] == "offline"
    ck = sorted((out / "checkpoints").glob("step_*"))
    assert len(ck) == 2 and (out / "checkpoints" / "latest").read_text() == ck[-1].name


@pytest.mark.parametrize(("spb", "ema"), [(1, 0.0), (2, 0.0), (1, 0.8)],
                         ids=["one-step-a-batch", "two-steps-a-batch", "ema"])  # fmt: skip
def test_resume_is_exact(tmp_path, data, monkeypatch, spb, ema):
    _, shards = data
    c = cfg(epochs=2, checkpoint_every=3, steps_per_batch=spb, ema=ema)  # spb 2: the checkpoint is mid-batch
    full = train(str(shards), str(tmp_path / "a"), c)

    class Killed(Exception):
        pass

    def kill(step):
        if step == 5:  # after step 5, past the checkpoint of step 3: steps 4-5 are lost and redone
            raise Killed

    monkeypatch.setattr(loop, "_after_step", kill)
    with pytest.raises(Killed):
        train(str(shards), str(tmp_path / "b"), c)
    monkeypatch.setattr(loop, "_after_step", lambda step: None)
    assert latest_checkpoint(tmp_path / "b").name == "step_00000003"
    resumed = train(str(shards), str(tmp_path / "b"), replace(c, resume=True))
    a, b = load_draft(full).state_dict(), load_draft(resumed).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6, msg=k)
    la = [(r["step"], r["loss"]) for r in metrics(tmp_path / "a") if r["split"] == "train"]
    lb = [(r["step"], r["loss"]) for r in metrics(tmp_path / "b") if r["split"] == "train"]
    assert [s for s, _ in lb] == [s for s, _ in la]  # no duplicated records after resume
    assert [x for _, x in lb] == pytest.approx([x for _, x in la], rel=1e-6)
    # resuming with other settings is refused
    with pytest.raises(ValueError, match="lr"):
        train(str(shards), str(tmp_path / "b"), replace(c, resume=True, lr=1.0))


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, data, monkeypatch):
    _, shards = data
    real_collate, calls = batches.collate, []

    def poisoned(samples, max_length, all_tokens=False):
        b = real_collate(samples, max_length, all_tokens)
        calls.append(1)
        if len(calls) == 3:  # the batch of step 3
            b.aux[0, 1, 0] = float("nan")
        return b

    monkeypatch.setattr(batches, "collate", poisoned)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3 .*samples \[.*step_00000002"):
        train(str(shards), str(out), cfg(val_fraction=0.0, checkpoint_every=1))
    ck = latest_checkpoint(out)
    assert ck.name == "step_00000002"
    state = torch.load(ck / STATE_FILE, weights_only=False)
    assert state["step"] == 2
    assert all(torch.isfinite(v).all() for v in load_draft(ck).state_dict().values() if v.is_floating_point())
    # the run continues from there once the data is good
    monkeypatch.setattr(batches, "collate", real_collate)
    train(str(shards), str(out), cfg(val_fraction=0.0, checkpoint_every=1, max_steps=4, resume=True))
    assert latest_checkpoint(out).name == "step_00000004"


def test_prompt_loss_scores_every_real_token_in_training_only(tmp_path, data, monkeypatch):
    def sample(mask):
        n = len(mask)
        return {
            "input_ids": torch.arange(1, n + 1),
            "loss_mask": torch.tensor(mask),
            "hidden": torch.ones(n, 4, 8),
        }

    rows = [sample([0, 0, 1, 1, 0]), sample([0, 1, 1])]
    torch.testing.assert_close(
        batches.collate(rows, 16).loss_mask, torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0.0]])
    )
    torch.testing.assert_close(batches.collate(rows, 16, all_tokens=True).loss_mask,
                               torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0.0]]))  # padding never  # fmt: skip
    # the trainer asks for it for its training batches; validation stays on the replies
    _, shards = data
    real_collate, seen = batches.collate, []

    def spy(samples, max_length, all_tokens=False):
        seen.append(all_tokens)
        return real_collate(samples, max_length, all_tokens)

    monkeypatch.setattr(batches, "collate", spy)
    train(str(shards), str(tmp_path / "p"), cfg(prompt_loss=True, max_steps=2, checkpoint_every=10))
    assert True in seen and False in seen
    seen.clear()
    train(str(shards), str(tmp_path / "r"), cfg(max_steps=2, checkpoint_every=10))
    assert set(seen) == {False}


def test_steps_per_batch_split_each_rows_scored_tokens_in_order(tmp_path, data, monkeypatch):
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0], [0.0] * 8])
    parts = [batches.loss_part(mask, j, 2) for j in range(2)]
    torch.testing.assert_close(
        parts[0], torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0.0] * 8])
    )
    torch.testing.assert_close(parts[0] + parts[1], mask)  # a partition: every scored token once
    thirds = torch.stack([batches.loss_part(mask, j, 3) for j in range(3)])  # (3, B, T)
    torch.testing.assert_close(thirds.sum(0), mask)
    assert thirds.sum(2)[:, 0].tolist() == [2, 2, 1] and thirds.amax(0).le(1).all()  # near-equal shares
    # the trainer: N optimizer steps per batch, step j of a batch scoring share j of its loss mask
    _, shards = data
    real, seen = loop.loss_part, []
    monkeypatch.setattr(loop, "loss_part", lambda m, j, n: seen.append((j, n)) or real(m, j, n))
    one = train(str(shards), str(tmp_path / "one"), cfg(epochs=1, val_fraction=0.0))
    two = train(str(shards), str(tmp_path / "two"), cfg(epochs=1, val_fraction=0.0, steps_per_batch=2))
    n1, n2 = (json.loads((f / "config.json").read_text())["train"]["steps"] for f in (one, two))
    assert n2 == 2 * n1 and seen == [(0, 2), (1, 2)] * n1
    tr = [r for r in metrics(tmp_path / "two") if r["split"] == "train"]
    assert sum(r["tokens"] for r in tr) == sum(  # each step records its share of its batch's tokens
        r["tokens"] for r in metrics(tmp_path / "one") if r["split"] == "train"
    )


def test_online_equals_offline(tmp_path, data, tiny_llama_dir):
    ds, shards = data
    c = cfg(epochs=1, max_steps=4)
    off = train(str(shards), str(tmp_path / "off"), c)
    on = train(str(ds), str(tmp_path / "on"), replace(c, online=True, target=str(tiny_llama_dir)))
    la = [r["loss"] for r in metrics(tmp_path / "off")]
    lb = [r["loss"] for r in metrics(tmp_path / "on")]
    assert len(la) == len(lb) and lb == pytest.approx(la, rel=1e-4, abs=1e-5)
    a, b = load_draft(off).state_dict(), load_draft(on).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=k)


@pytest.mark.parametrize(
    "schedule, expect",
    [
        ("constant", [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
        ("linear", [0.5, 1, 1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8]),
        ("wsd", [0.5, 1, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3]),
    ],  # fmt: skip
)
def test_lr_schedules(schedule, expect):
    # 10 steps, 2 of warmup; wsd decays over the last round(0.3 * 10) = 3, toward min_lr_ratio 0.1
    f = setup._lr_lambda(TrainConfig(schedule=schedule, warmup_ratio=0.2, cooldown_ratio=0.3), 10)
    assert [f(s) for s in range(10)] == pytest.approx(expect)
    g = setup._lr_lambda(
        TrainConfig(schedule="wsd", warmup_ratio=0.2, cooldown_ratio=0.3, min_lr_ratio=0.1), 10
    )
    assert [g(s) for s in (7, 8, 9)] == pytest.approx([1, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3])


def test_ema_final_weights_are_the_moving_average_of_the_steps(tmp_path, data):
    _, shards = data
    c = cfg(epochs=1, max_steps=3, checkpoint_every=1, keep_checkpoints=5, ema=0.5, val_fraction=0.0)
    final = train(str(shards), str(tmp_path / "e"), c)
    ckpts = sorted((tmp_path / "e" / "checkpoints").glob("step_*"))  # the raw weights w1..w3
    w = [load_draft(p).state_dict() for p in ckpts]
    assert len(w) == 3
    got = load_draft(final).state_dict()
    for k in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"):
        # bias-corrected: step s of t = 3 weighted 0.5**(t - s), normalised; the init has no weight
        weights = [0.5 ** (len(w) - s) for s in range(1, len(w) + 1)]  # 0.25, 0.5, 1
        want = sum(a * step[k] for a, step in zip(weights, w)) / sum(weights)
        torch.testing.assert_close(got[k], want, atol=1e-6, rtol=1e-6, msg=k)
        assert (got[k] - w[-1][k]).abs().max() > 1e-4, k  # not the last step's weights


def test_user_errors_are_collected(tmp_path, data):
    _, shards = data
    with pytest.raises(ValueError) as e:
        train(
            str(shards),
            str(tmp_path / "x"),
            cfg(
                ttt_steps=0,
                decay=2.0,
                lr=-1,
                schedule="step",
                layers=[1, 2, 3],
                cooldown_ratio=0,
                hard_weight=2,
                steps_per_batch=0,
                fc_init="identity",
                ema=1.0,
            ),
        )
    msg = str(e.value)
    for part in (
        "--ttt-steps",
        "--decay",
        "--lr",
        "--schedule",
        "--layers",
        "--cooldown-ratio",
        "--hard-weight",
        "--steps-per-batch",
        "--fc-init",
        "--ema",
    ):
        assert part in msg
    with pytest.raises(ValueError, match="no checkpoint"):
        train(str(shards), str(tmp_path / "x"), cfg(resume=True))
    with pytest.raises(ValueError, match="not a directory"):
        train(str(tmp_path / "missing"), str(tmp_path / "x"), cfg())


def test_existing_output_needs_resume(tmp_path, data):
    _, shards = data
    train(str(shards), str(tmp_path / "o"), cfg(max_steps=2, epochs=1))
    with pytest.raises(ValueError, match="--resume"):
        train(str(shards), str(tmp_path / "o"), cfg(max_steps=2, epochs=1))


@pytest.mark.slow
@pytest.mark.real
def test_real_target_short_run_learns(tmp_path):
    """SmolLM2-135M on real ShareGPT: validation loss falls and step-0 accuracy rises well above the untrained draft."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    ds = prepare("sharegpt", str(tmp_path / "ds"), max_length=256, max_samples=64)
    shards = extract(str(ds), str(tmp_path / "x"), samples_per_shard=32, skip_doctor=True)
    c = TrainConfig(draft_vocab_size=4096, ttt_steps=3, epochs=3, lr=1e-3, warmup_ratio=0.05, max_tokens=2048,
                    max_length=256, val_fraction=0.1, checkpoint_every=1000, progress=False, tensorboard=False)  # fmt: skip
    train(str(shards), str(tmp_path / "run"), c)
    val = [r for r in metrics(tmp_path / "run") if r["split"] == "val"]
    assert val[-1]["loss"] < 0.8 * val[0]["loss"], (val[0], val[-1])
    assert val[-1]["acc"][0] > val[0]["acc"][0] + 0.1, (val[0]["acc"], val[-1]["acc"])


def test_training_png_is_drawn_during_training(tmp_path, data, monkeypatch):
    """training.png appears at the first mid-run checkpoint (not only at the end), and is redrawn with later ones."""
    _, shards = data
    seen = {}

    out = {"dir": tmp_path / "run"}

    def look(step):
        png = out["dir"] / "training.png"
        seen[step] = png.stat().st_mtime_ns if png.exists() else None

    monkeypatch.setattr(loop, "_after_step", look)
    monkeypatch.setattr(loop, "PLOT_EVERY_S", 0.0)  # every chance (a real run: at most once a minute)
    train(str(shards), str(tmp_path / "run"), cfg(epochs=2, checkpoint_every=2, val_every=3))
    assert seen[1] is None and seen[2] is not None  # drawn with the checkpoint of step 2
    assert seen[3] is not None and seen[3] >= seen[2]  # and redrawn with step 3's validation
    assert not list((tmp_path / "run").glob(".*.tmp"))  # written whole
    # at the default pace a short run draws it once, at the end
    seen.clear()
    out["dir"] = tmp_path / "run2"
    monkeypatch.setattr(loop, "PLOT_EVERY_S", 3600.0)
    train(str(shards), str(tmp_path / "run2"), cfg(epochs=1, checkpoint_every=1))
    assert set(seen.values()) == {None} and (tmp_path / "run2" / "training.png").is_file()


def test_a_signal_while_training_png_draws_is_delivered_after_it(tmp_path, monkeypatch):
    """SIGTERM inside matplotlib could land in a finalizer and be dropped; it is held, then raised after."""
    import os
    import signal

    from specdraft.train.report import plot

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    before = signal.signal(signal.SIGTERM, stop)
    try:
        drawn = []

        def draw(recs, png):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-drawing
            png.write_bytes(b"png")
            drawn.append(png)

        monkeypatch.setattr(plot, "_draw", draw)
        (tmp_path / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 1.0}\n')
        with pytest.raises(Stop):
            plot.plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "training.png")
        assert drawn and (tmp_path / "training.png").read_bytes() == b"png"  # the drawing finished first
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, before)
