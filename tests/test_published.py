"""Published drafts in: a speculators-format EAGLE-3 draft (and one in EAGLE-3's original layout), built here
from a tiny config written in the published layout, is evaluated by `eval` and continued by `train --init-from`,
with the draft vocabulary map (d2t/t2d) it carries."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_jsonl
from safetensors.torch import save_file
from test_train_rough_edges import shards  # noqa: F401  (the module's fixture)

from specdraft.cli import main
from specdraft.model.checkpoint import load_trained

H, FF, NH, NKV, V, VD = 64, 128, 4, 2, 300, 64  # the tiny Llama of conftest; a draft vocabulary of 64


def _weights(prefix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    d = H // NH
    w = {"fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": r(VD, H)}
    layer = {"input_layernorm.weight": torch.ones(H), "hidden_norm.weight": torch.ones(H),
             "post_attention_layernorm.weight": torch.ones(H), "self_attn.q_proj.weight": r(NH * d, 2 * H),
             "self_attn.k_proj.weight": r(NKV * d, 2 * H), "self_attn.v_proj.weight": r(NKV * d, 2 * H),
             "self_attn.o_proj.weight": r(H, NH * d), "mlp.gate_proj.weight": r(FF, H), "mlp.up_proj.weight": r(FF, H),
             "mlp.down_proj.weight": r(H, FF)}  # fmt: skip
    w |= {prefix + k: v for k, v in layer.items()}
    ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values  # the draft's target ids, ascending
    w["d2t"] = ids - torch.arange(VD)  # offsets: draft id i is target id i + d2t[i]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    return w


LAYER = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FF,
         "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": 1, "vocab_size": V,
         "draft_vocab_size": VD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip


@pytest.fixture(scope="module")
def speculators(tmp_path_factory, tiny_llama_dir):
    """A speculators-format draft as published (no aux layer ids recorded: EAGLE-3's default applies)."""
    d = tmp_path_factory.mktemp("published") / "eagle3-speculators"
    d.mkdir()
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.1.0", "transformer_layer_config": LAYER, "draft_vocab_size": VD,
              "norm_before_residual": False, "target_hidden_size": H,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": str(tiny_llama_dir),
                                                  "architectures": ["LlamaForCausalLM"]}}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    w = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in _weights("layers.0.").items()}
    save_file(w, str(d / "model.safetensors"))
    return d


def test_a_speculators_draft_loads_with_its_vocabulary_map(speculators, tiny_llama_dir):
    from specdraft.targets import load_target

    tgt = load_target(str(tiny_llama_dir), with_tokenizer=False)
    draft = load_trained(speculators, target=tgt)
    w = _weights("layers.0.")
    assert draft.cfg.aux_layer_ids == [2, 4, 5] and draft.cfg.draft_vocab_size == VD
    assert torch.equal(draft.d2t, w["d2t"]) and torch.equal(draft.t2d, w["t2d"])
    assert torch.equal(
        draft.midlayer.self_attn.q_proj.weight, w["layers.0.self_attn.q_proj.weight"].bfloat16().float()
    )
    assert torch.equal(draft.embed_tokens.weight, tgt.embed_tokens.weight.float())  # the target's, frozen


def test_eval_measures_a_published_draft(speculators, tiny_llama_dir, tmp_path, capsys):
    """No --target: the one the draft names (speculators' verifier); k 3, as export writes."""
    q = write_jsonl(
        tmp_path / "q.jsonl", [{"question_id": 0, "category": "writing", "turns": ["Write a poem"]}]
    )
    out = tmp_path / "eval"
    argv = [
        "eval",
        str(speculators),
        "--prompts",
        str(q),
        "--max-new-tokens",
        "6",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0  # greedy: lossless
    assert f"eval: --target {tiny_llama_dir} (the target {speculators} records)" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    d = report["drafts"][str(speculators)]
    assert d["lossless"]["checked"] and d["lossless"]["ok"] and len(d["acceptance_rate_per_position"]) == 3


def test_train_continues_a_published_draft(speculators, shards, tmp_path):  # noqa: F811
    out = tmp_path / "warm"
    argv = ["train", str(shards), str(out), "--init-from", str(speculators), "--draft-vocab-size", str(VD),
            "--ttt-steps", "2", "--max-length", "96", "--val-fraction", "0", "--max-steps", "2", "--no-progress",
            "--no-tensorboard"]  # fmt: skip
    assert main(argv) == 0
    warm = load_trained(out / "final")
    w = _weights("layers.0.")
    assert torch.equal(warm.d2t, w["d2t"]) and torch.equal(warm.t2d, w["t2d"])  # the published vocabulary
    assert warm.cfg.aux_layer_ids == [2, 4, 5]
    meta = json.loads((out / "final" / "config.json").read_text())
    assert meta["train"]["init_from"] == str(speculators)


def test_eagle3_layout_with_sglang_layer_ids_and_a_bin_file(tmp_path):
    d = tmp_path / "eagle3"
    d.mkdir()
    config = {**LAYER, "architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": H,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    torch.save(_weights("midlayer.", seed=1), d / "pytorch_model.bin")
    draft = load_trained(d)
    assert draft.cfg.aux_layer_ids == [2, 4, 5]  # SGLang counts one lower than vLLM and specdraft
    assert torch.equal(draft.fc.weight, _weights("midlayer.", seed=1)["fc.weight"])


def test_something_else_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"]}))
    with pytest.raises(ValueError, match="neither a specdraft draft .* nor a published EAGLE-3 draft"):
        load_trained(tmp_path)


def test_doctor_export_reads_a_published_draft_as_vllm_does(speculators):
    """No aux layer ids recorded: vLLM asks the target for EAGLE-3's default layers, the ids eval and train
    --init-from take ([2, 4, 5] of the verifier's 8 layers): a warning that says so, not a break."""
    from specdraft.doctor.check import installed_root
    from specdraft.doctor.formats.check import check_export_dir
    from specdraft.doctor.source.reader import SourceTree
    from specdraft.engine.formats import VLLM_FORMATS

    root = installed_root("vllm")
    if root is None:
        pytest.skip("vllm is not installed: its source is what doctor reads")
    problems = check_export_dir(VLLM_FORMATS, SourceTree(root), speculators)
    assert [p.message for p in problems if p.severity == "break"] == []
    (aux,) = [p for p in problems if "eagle_aux_hidden_state_layer_ids" in p.message]
    assert aux.severity == "warning" and "[2, 4, 5] for the target's 8 layers" in aux.message
    assert (
        "get_eagle3_default_aux_hidden_state_layers returns (2, num_layers // 2, num_layers - 3)"
        in aux.message
    )


def _engine_source(tmp_path, returns: str | None, caller: bool = True):
    """A stand-in vLLM source tree: the target's default aux layers and the runner that falls back to them."""
    from specdraft.doctor.source.reader import SourceTree

    models, worker = tmp_path / "vllm/model_executor/models", tmp_path / "vllm/v1/worker"
    for d in (models, worker, tmp_path / "vllm", tmp_path / "vllm/model_executor", tmp_path / "vllm/v1"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    body = (
        f"    def get_eagle3_default_aux_hidden_state_layers(self):\n        return {returns}\n"
        if returns
        else "    pass\n"
    )
    (models / "interfaces.py").write_text(f"class SupportsEagle3:\n{body}")
    call = "self.model.get_eagle3_default_aux_hidden_state_layers()" if caller else "None"
    (worker / "gpu_model_runner.py").write_text(f"def setup(self):\n    return {call}\n")
    return SourceTree(tmp_path)


@pytest.mark.parametrize(
    "returns, caller, said",
    [
        ("(1, num_layers // 2, num_layers - 1)", True, "returns (1, num_layers // 2, num_layers - 1)"),
        ("(2, num_layers // 2, num_layers - 3)", False, "calls vllm.model_executor.models.interfaces"),
        (None, True, "is not found"),
    ],
)
def test_doctor_breaks_when_the_engine_would_default_other_layers(tmp_path, returns, caller, said):
    from specdraft.doctor.formats.check import _engine_defaults
    from specdraft.engine.formats import VLLM_FORMATS

    spec, eagle3 = VLLM_FORMATS
    tree = _engine_source(tmp_path, returns, caller)
    config = {"speculators_model_type": "eagle3"}
    (p,) = _engine_defaults(spec, tree, "speculators export", "D", config, 8)
    assert (
        p.severity == "break"
        and said in p.message
        and "lacks `eagle_aux_hidden_state_layer_ids`" in p.message
    )
    # the eagle3 layout's eagle_config ids are read before the default: it is not reached
    assert (
        _engine_defaults(
            eagle3, tree, "eagle3 export", "D", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}}, 8
        )
        == []
    )
