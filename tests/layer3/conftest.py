"""Tiny random Hugging Face checkpoints for the layer-3 executor tests.

`transformers` builds the models (test-only dependency); every parameter is re-drawn
(norm weights and biases too, which HF initialises to 1 and 0 and would hide a swapped
or dropped tensor), saved with save_pretrained as safetensors beside a tiny byte-level
BPE tokenizer trained here.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

VOCAB = 300
TEXT = (
    "To be, or not to be, that is the question. Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune. Café crème, naïve façade, über straße. "
    "日本語のテキスト. Emoji 🙂 and 🎭 on the stage. All the world's a stage, and all the men "
    "and women merely players; they have their exits and their entrances. "
) * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# name -> (architecture, config overrides)
CONFIGS = {
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-tied-rope3": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=6)),
}


def hf_model(arch: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of a tiny Llama-family config, eval mode."""
    tf = pytest.importorskip("transformers")
    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def train_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer.json (<s> prepended) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory, tokenizer_dir):
    """make_checkpoint(name, **save_kwargs) -> (directory, hf model): CONFIGS[name] saved
    with save_pretrained (once per name and kwargs) plus the tokenizer files."""
    made: dict = {}

    def make(name: str, **save_kwargs):
        key = (name, tuple(sorted(save_kwargs.items())))
        if key not in made:
            arch, overrides = CONFIGS[name]
            model = hf_model(arch, **overrides)
            out = tmp_path_factory.mktemp(name)
            model.save_pretrained(out, **save_kwargs)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer_dir / f, out / f)
            made[key] = (out, model)
        return made[key]

    return make


@pytest.fixture(scope="module")
def single_thread():
    """Tiny matmuls: one intra-op thread is faster, and immune to other processes on the
    same cores (with two busy cores, OpenMP barriers made each 64x256 matmul take ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
