"""The serving engine's renderer as the check (issue 47): every sample of the embedded default checked against
vLLM's own rendering of the chat (its template resolution, message parsing and tokenization), and a template the
engine renders differently (a gpt-oss-style template reading `thinking`, which vLLM's HF path never passes) drops
the conversation with a reason naming vLLM and the first difference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import needs_vllm  # noqa: E402
from standin_templates import TEMPLATES  # noqa: E402
from test_served_samples import SHAPES  # noqa: E402

pytestmark = needs_vllm


def _write(tmp_path, rows: list) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_samples_of_the_embedded_default_are_what_vllm_renders(tmp_path):
    from specdraft.data.prepare import load_dataset, prepare
    from specdraft.data.render import decode
    from specdraft.targets import load_tokenizer

    shapes = ["reasoning_content, 3 turns", "inline reasoning, 2 turns", "no reasoning, 2 turns"]
    out = prepare(str(_write(tmp_path, [SHAPES[s] for s in shapes])), str(tmp_path / "ds"))
    man = json.loads((out / "manifest.json").read_text())
    assert man["renderer"].startswith("vllm ") and man["dropped"] == {}, man["dropped"]
    assert man["num_conversations"] == 3
    # the prompt of every sample is, token for token, what vLLM renders and tokenizes for that turn
    from specdraft.data.engine_render import as_client_sends, engine_renderer
    from specdraft.data.messages import normalize_record
    from specdraft.targets import locate_target

    engine, _ = engine_renderer(locate_target("smollm2-135m"), None, "vllm")
    tok = load_tokenizer("smollm2-135m")
    ds = load_dataset(out)
    for row, shape in enumerate(shapes):
        conv, _ = normalize_record(SHAPES[shape])
        ids, mask = ds.input_ids[row], ds.loss_mask[row]
        first = mask.index(1)
        text, engine_ids = engine.render(as_client_sends(conv.messages[:1 + (conv.messages[0]["role"] == "system")]),
                                         None, True, {})  # fmt: skip
        assert ids[:first] == engine_ids and decode(tok, ids[:first]) == text


def test_a_template_the_engine_renders_differently_drops_the_conversation(tmp_path):
    """The gpt-oss-style template reads reasoning from `thinking`: prepare gives it there, so a tool-calling
    turn's analysis stays in the next turn's prompt; vLLM's HF path passes a client's reasoning as `reasoning`
    and `reasoning_content` only, so the prompt it serves has no analysis: the conversation is dropped, the
    reason naming vLLM and the first difference. A conversation without reasoning in history is kept."""
    from specdraft.data.prepare import prepare

    rows = [SHAPES["parallel calls + results"], SHAPES["no reasoning, 2 turns"]]
    out = prepare(str(_write(tmp_path, rows)), str(tmp_path / "ds"), chat_template=str(TEMPLATES["gpt_oss"]))
    man = json.loads((out / "manifest.json").read_text())
    assert man["renderer"].startswith("vllm ") and man["num_conversations"] == 1
    ((reason, where),) = man["dropped"].items()
    assert where["records"] == [0]
    # the tool-calling turn itself: the template shows its analysis, vLLM's rendering of it has none
    assert reason.startswith("vllm ") and "renders a turn unlike the template" in reason
    assert (
        "first difference at char" in reason
        and "template '<|channel|>analysis<|message|>Two tools." in reason
    )
    # the template alone (no engine) keeps it
    out = prepare(str(_write(tmp_path, rows)), str(tmp_path / "t"), chat_template=str(TEMPLATES["gpt_oss"]),
                  renderer="template")  # fmt: skip
    man = json.loads((out / "manifest.json").read_text())
    assert man["renderer"] == "template" and man["num_conversations"] == 2


def test_renderer_vllm_refuses_a_target_it_cannot_check(tmp_path):
    from conftest import CHATML, build_tokenizer

    from specdraft.data.prepare import prepare

    d = tmp_path / "tok"
    build_tokenizer(CHATML).save_pretrained(d)  # a tokenizer alone: no config.json for vLLM to load
    data = _write(tmp_path, [SHAPES["no reasoning, 2 turns"]])
    with pytest.raises(ValueError, match="^--renderer vllm: the target has no config.json"):
        prepare(str(data), str(tmp_path / "ds"), target=str(d), renderer="vllm")
    out = prepare(str(data), str(tmp_path / "ds2"), target=str(d))
    assert json.loads((out / "manifest.json").read_text())["renderer"].startswith("template (")
