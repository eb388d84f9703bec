"""Stand-in chat templates of four reasoning/tool-calling families, written in this project (not copied).

``tests/templates/*.jinja`` behave like Qwen3's hybrid thinking (``hybrid_thinking``), DeepSeek-R1
(``deepseek_r1``), Kimi-K2-Thinking (``kimi_k2_thinking``, with K2.5's ``thinking`` switch), Llama-3.1 with
tools (``llama31_tools``), gpt-oss's harmony format (``gpt_oss``, reasoning read from ``thinking``) and Mistral's
v3 tool calling (``mistral``, reasoning read from ``reasoning``); tests/templates/README.md says what each
was learned from and how it treats reasoning, tools, the generation prompt and the end of a turn.
``standin_tokenizer(name)`` gives the tiny offline tokenizer of tests/conftest.py with that template and
each of its special markers as one token.
"""

from __future__ import annotations

from pathlib import Path

from conftest import build_tokenizer

HERE = Path(__file__).parent / "templates"
TEMPLATES: dict[str, Path] = {
    "hybrid_thinking": HERE / "hybrid_thinking.jinja",
    "deepseek_r1": HERE / "deepseek_r1.jinja",
    "kimi_k2_thinking": HERE / "kimi_k2_thinking.jinja",
    "llama31_tools": HERE / "llama31_tools.jinja",
    "gpt_oss": HERE / "gpt_oss.jinja",
    "mistral": HERE / "mistral.jinja",
    "deepseek_v31": HERE / "deepseek_v31.jinja",
    "glm45": HERE / "glm45.jinja",
}
SPECIAL_TOKENS: dict[str, list[str]] = {
    "hybrid_thinking": [
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "deepseek_r1": [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ],
    "kimi_k2_thinking": [
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
    "llama31_tools": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gpt_oss": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"],
    "mistral": [
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_CALLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[THINK]",
        "[/THINK]",
    ],
    "glm45": [
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
}
# DeepSeek-V3.1 keeps R1's markers but the block around tool outputs (each output is wrapped alone)
SPECIAL_TOKENS["deepseek_v31"] = [t for t in SPECIAL_TOKENS["deepseek_r1"] if "outputs" not in t]
#: the stop ids each stand-in's generation_config lists (`eos_token_id`), as tokens; the others stop on their eos
GENERATION_STOPS: dict[str, list[str]] = {"glm45": ["<|endoftext|>", "<|user|>", "<|observation|>"]}
# bos/eos as the real tokenizers set them (the others keep conftest's eos <|im_end|>, which is their end of turn)
_BOS_EOS = {"deepseek_r1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
            "llama31_tools": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "gpt_oss": {"eos_token": "<|return|>"}, "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
            "deepseek_v31": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
            "glm45": {"eos_token": "<|endoftext|>"}}  # fmt: skip


def standin_tokenizer(name: str):
    """A fast tokenizer with the stand-in template `name` and each of its special markers as one token."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown stand-in template {name!r}; pick one of {sorted(TEMPLATES)}")
    tok = build_tokenizer(TEMPLATES[name].read_text())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[name], **_BOS_EOS.get(name, {})})
    return tok


def standin_stop_ids(name: str, tok) -> tuple[int, ...]:
    """The stop ids of the stand-in's generation_config (`GENERATION_STOPS`), else its tokenizer's eos."""
    from specdraft.targets import stop_ids

    stops = GENERATION_STOPS.get(name)
    return stop_ids(tok, {"eos_token_id": tok.convert_tokens_to_ids(stops)} if stops else None)


def standin_target(name: str, out: Path) -> Path:
    """A target directory vLLM's renderer loads (config.json, no weights: rendering reads none): the stand-in
    tokenizer with its template, and a generation_config.json listing its stop ids (`GENERATION_STOPS`)."""
    import json

    from transformers import LlamaConfig

    tok = standin_tokenizer(name)
    tok.save_pretrained(out)
    LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1).save_pretrained(out)  # fmt: skip
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(standin_stop_ids(name, tok))})
    )
    return out
