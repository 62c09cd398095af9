"""SmolLM2-135M-Instruct from its Q4_1 GGUF against transformers' own GGUF loader:
logits, tokenization, the rendered chat prompt. (Greedy generation through the layer-4
engine: tests/layer4/test_gguf_engine.py.)"""
# ruff: noqa: F811  (the shared fixtures are imported, then named as test arguments)
from __future__ import annotations

import pytest
import torch

from .smollm2 import (  # noqa: F401  (fixtures)
    CHATS,
    hf_smollm2,
    hf_smollm2_tokenizer,
    smollm2,
    smollm2_file,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Café crème, naïve façade — 日本語のテキスト 🙂",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]
# Text with Unicode, code, emoji and whitespace runs (no digits: see test_digits_split).
TEXTS = [
    "Hello  world\n\n\n   indented\ttabs\t\tand trailing spaces   ",
    "Ünïcödé façade, straße, 日本語のテキスト, Ελληνικά, русский текст",
    "emoji 🙂🎭👍🏽 and ZWJ 👨‍👩‍👧 families",
    "def f(x):\n    return {'a': x, \"b\": [x, x]}  # comment\n\nclass A:\n    pass\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "    \n\t \r\n  mixed whitespace runs\u00a0\u2003here",
]


def test_logits_match_transformers(smollm2, hf_smollm2):
    for prompt in PROMPTS:
        ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
        with torch.no_grad():
            ours = smollm2.net.causal_lm_logits(ids)[0]
            ref = hf_smollm2(ids).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), prompt


def test_tokenization_matches_transformers(smollm2, hf_smollm2_tokenizer):
    for text in TEXTS:
        ours = smollm2.tokenizer.encode(text)
        assert ours == hf_smollm2_tokenizer(text).input_ids, text
        assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_split(smollm2):
    """The file says tokenizer.ggml.pre = "smollm": like llama.cpp (and SmolLM2's own
    tokenizer.json, Digits(individual_digits=True)) every digit is its own word.
    transformers' GGUF converter ignores this pre name and keeps runs of digits together,
    so digits are checked here against the rule, not against it."""
    tok = smollm2.tokenizer
    assert tok.encode("12345") == [tok.tok.token_to_id(d) for d in "12345"]
    assert tok.decode(tok.encode("x = 2024 + 7")) == "x = 2024 + 7"


def test_chat_prompt_matches_transformers(smollm2, hf_smollm2_tokenizer):
    conversations = [
        [{"role": "user", "content": "Hi there!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
         {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Ok 🙂"}],
    ]
    for messages in conversations:
        ours = smollm2.tokenizer.apply_chat_template(messages)
        ref = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
        assert ours == ref
    assert smollm2.eos_token_ids == (hf_smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_model_info(smollm2_file):
    from layer3_model.models_command import describe

    info = describe("smollm2")
    assert info["architecture"] == "llama" and info["num_hidden_layers"] == 30
    assert info["num_key_value_heads"] == 3 and info["tie_word_embeddings"]
    assert info["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
