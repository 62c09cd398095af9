"""config.json parsing, safetensors loading with merged projections, the tokenizer, and the
attention-context / KV-cache seam."""
from __future__ import annotations

import json
import shutil

import jinja2
import pytest
import torch

import layer3_model as l3

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


# ---- config ------------------------------------------------------------------------------
def test_config_reads_transformers_4_and_5_spellings():
    v4 = l3.ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                                   "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                   "eos_token_id": [128001, 128009], "tie_word_embeddings": True})
    v5 = l3.ModelConfig.from_dict({**BASE, "model_type": "llama", "dtype": "bfloat16", "eos_token_id": [128001, 128009],
                                   "tie_word_embeddings": True,
                                   "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192}})
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling.factor == 32.0 and v4.rope_scaling.rope_type == "llama3"
    assert v4.torch_dtype == torch.bfloat16 and v4.eos_token_ids == (128001, 128009) and v4.tie_word_embeddings
    assert v4.head_dim == 16 and v4.q_size == 64 and v4.kv_size == 32


def test_config_architecture_switches():
    llama = l3.ModelConfig.from_dict({"model_type": "llama", **{**BASE, "num_key_value_heads": None}})
    assert llama.num_key_value_heads == 4 and not llama.qkv_bias and llama.layer_windows == (None, None)
    biased = l3.ModelConfig.from_dict({**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True})
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    qwen = l3.ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.layer_windows == (None, None)
    qwen_sw = l3.ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
                                        "max_window_layers": 1})
    assert qwen_sw.layer_windows == (None, 8)
    mistral = l3.ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 4096, "head_dim": 32})
    assert mistral.layer_windows == (4096, 4096) and mistral.head_dim == 32 and mistral.q_size == 128


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3, mistral"):
        l3.ModelConfig.from_dict({**BASE, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="'yarn'"):
        l3.ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        l3.ModelConfig.from_dict({**BASE, "model_type": "llama", "num_key_value_heads": 3})
    with pytest.raises(FileNotFoundError, match="config.json"):
        l3.ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        l3.load(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-rope3"])
def test_rope_frequencies_match_transformers(make_checkpoint, name):
    path, hf = make_checkpoint(name)
    ours = l3.ModelConfig.from_pretrained(path).rope_inv_freq()
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)


# ---- weights -----------------------------------------------------------------------------
def test_projections_are_merged_at_load(make_checkpoint):
    path, hf = make_checkpoint("qwen2-bias")
    net = l3.load_model(path)
    hf_attn, hf_mlp, ours = hf.model.layers[1].self_attn, hf.model.layers[1].mlp, net.layers[1]
    assert torch.equal(ours.attn.qkv.weight, torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]))
    assert torch.equal(ours.attn.qkv.bias, torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]))
    assert torch.equal(ours.mlp.gate_up.weight, torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))
    assert ours.attn.qkv.weight.shape == (64 + 2 * 64, 64)  # MHA: 4 kv heads of 16
    assert net.lm_head.weight is net.embed.weight  # tied: one tensor


def test_load_in_other_dtypes(make_checkpoint):
    path, _ = make_checkpoint("llama-gqa")
    for dtype, expected in (("bf16", torch.bfloat16), (torch.float16, torch.float16)):
        model = l3.load(path, dtype=dtype, device="cpu")
        assert model.net.dtype == expected
        assert model.net.cos.dtype == torch.float32  # RoPE tables stay fp32
    params = l3.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = l3.load(path, dtype="bfloat16", device="cpu").generate_outputs([[1, 5, 9]], params)
    assert len(out[0].token_ids) == 3


def test_weight_file_errors(make_checkpoint, tmp_path):
    path, _ = make_checkpoint("llama-gqa")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        l3.load_model(tmp_path)
    sharded, _ = make_checkpoint("llama-gqa", max_shard_size="40KB")
    broken = tmp_path / "sharded"
    shutil.copytree(sharded, broken)
    next(broken.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard model-0000"):
        l3.load_model(broken)


def _write(out, source, tensors):
    """A checkpoint directory with source's config.json and these tensors."""
    from safetensors.torch import save_file
    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    save_file(tensors, out / "model.safetensors")
    return out


def test_missing_unexpected_and_misshapen_tensors_are_named(make_checkpoint, tmp_path):
    path, _ = make_checkpoint("llama-gqa")
    tensors = l3.read_safetensors(path)
    dropped = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 tensors \['model.layers.1.self_attn.k_proj.weight'\]"):
        l3.load_model(_write(tmp_path / "a", path, dropped))
    extra = {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ValueError, match="unexpected 1 .*q_norm"):
        l3.load_model(_write(tmp_path / "b", path, extra))
    wrong = {**tensors, "model.norm.weight": torch.ones(32)}
    with pytest.raises(ValueError, match=r"norm.weight: shape \(32,\).*\(64,\) expected"):
        l3.load_model(_write(tmp_path / "c", path, wrong))


def test_save_weights_round_trips_through_transformers(make_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, hf = make_checkpoint("llama-tied-rope3")
    net = l3.load_model(path)
    l3.save_weights(net, tmp_path)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 4, 90, 33, 7]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits, atol=0, rtol=0)


def test_random_model_has_the_configs_shape():
    cfg = l3.ModelConfig.from_dict({**BASE, "model_type": "llama"})
    net = l3.random_model(cfg, seed=1)
    assert net.layers[0].attn.qkv.weight.shape == (cfg.q_size + 2 * cfg.kv_size, 64)
    assert net.layers[0].mlp.gate_up.weight.shape == (256, 64)
    assert torch.equal(net.norm.weight, torch.ones(64))
    assert torch.equal(l3.random_model(cfg, seed=1).embed.weight, net.embed.weight)


# ---- tokenizer ---------------------------------------------------------------------------
def test_tokenizer_encode_decode_and_special_tokens(tokenizer_dir):
    tok = l3.Tokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode("To be, or not to be")
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.decode(ids) == "To be, or not to be"
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        l3.Tokenizer.from_pretrained(tokenizer_dir / "missing")


def test_chat_template_renders_in_a_sandbox(tokenizer_dir):
    tok = l3.Tokenizer.from_pretrained(tokenizer_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Speak."}])
    assert text == "<s><|user|>Speak.</s><|assistant|>"
    assert tok.encode_chat([{"role": "user", "content": "Speak."}]).count(1) == 1  # one BOS, from the template
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
    evil = l3.Tokenizer(tok.tok, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        l3.Tokenizer(tok.tok).apply_chat_template([])


def test_incremental_decoder_never_emits_partial_utf8(tokenizer_dir):
    tok = l3.Tokenizer.from_pretrained(tokenizer_dir)
    text = "Café 🙂 日本語 über 🎭!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # multi-byte characters really are split over tokens
    dec = tok.decoder()
    deltas = [dec.step(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens completed no character and were held back


# ---- the attention context and the contiguous KV cache -----------------------------------
def test_attention_context_metadata():
    cache = l3.ContiguousKVCache(2, 3, 10, 2, 16)
    ctx = cache.context([3, 1], [0, 4], rows=[2, 0])
    assert ctx.positions.tolist() == [0, 1, 2, 4]
    assert ctx.slot_mapping.tolist() == [20, 21, 22, 4]
    assert ctx.seq_ids.tolist() == [0, 0, 0, 1] and ctx.query_offsets.tolist() == [0, 1, 2, 0]
    assert ctx.query_start_loc.tolist() == [0, 3, 4] and ctx.seq_lens.tolist() == [3, 5]
    assert (ctx.max_query_len, ctx.max_seq_len, ctx.num_tokens, ctx.num_seqs) == (3, 5, 4, 2)
    assert ctx.block_tables.tolist() == [[2], [0]] and not ctx.is_prefill
    assert cache.context([2, 2], [0, 0]).is_prefill and cache.context([2, 2], [0, 0]).block_tables is None


def test_kv_cache_write_read_and_size():
    cache = l3.ContiguousKVCache(2, 2, 8, 2, 4, dtype=torch.bfloat16)
    assert cache.bytes_per_token == 2 * 2 * 2 * 4 * 2  # k and v, layers, kv heads, head dim, bytes
    assert cache.nbytes == cache.bytes_per_token * 2 * 8
    ctx = cache.context([3, 2], [0, 0], rows=[1, 0])
    k = torch.randn(5, 2, 4).to(torch.bfloat16)
    cache.write(1, k, -k, ctx)
    keys, values = cache.read(1, ctx)
    assert keys.shape == (2, 2, 3, 4)  # (B, kv_heads, max_seq_len, head_dim)
    assert torch.equal(keys[0].transpose(0, 1), k[:3]) and torch.equal(keys[1, :, :2].transpose(0, 1), k[3:])
    assert torch.equal(values[0].transpose(0, 1), -k[:3])
    assert torch.equal(cache.k[1, 1, :3], k[:3])  # sequence 0 lives in row 1


def test_context_and_cache_errors():
    cache = l3.ContiguousKVCache(1, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        cache.context([5], [4])
    with pytest.raises(ValueError, match="cache row 2 out of range"):
        cache.context([1], [0], rows=[2])
    with pytest.raises(ValueError, match="query lengths must be >= 1"):
        cache.context([0], [0])
    with pytest.raises(ValueError, match="one slot per new token"):
        l3.AttentionContext.build([2], [0], [0])
    with pytest.raises(ValueError, match="every KV cache dimension"):
        l3.ContiguousKVCache(1, 0, 8, 1, 4)


def test_config_json_eos_ids_join_the_tokenizers(make_checkpoint, tmp_path):
    path, _ = make_checkpoint("llama-gqa")
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["eos_token_id"] = [2, 7]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert l3.load(tmp_path / "m").eos_token_ids == (2, 7)


def test_meta_device_builds_shapes_without_drawing():
    """meta_device(): the module torch.device("meta") gives (every parameter and buffer, same
    shape and dtype, on meta) without running its init there; tensors elsewhere are still
    filled inside it."""
    cfg = l3.ModelConfig.from_dict(dict(l3.LLAMA_3_2_1B, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, vocab_size=50,
                                        max_position_embeddings=64))
    with torch.device("meta"):
        want = l3.LlamaModel(cfg)
    with l3.meta_device():
        got = l3.LlamaModel(cfg)
        cpu = torch.nn.init.normal_(torch.zeros(4, device="cpu"))
    assert cpu.abs().sum() > 0
    shapes = {k: (v.shape, v.dtype) for k, v in want.state_dict(keep_vars=True).items()}
    assert {k: (v.shape, v.dtype) for k, v in got.state_dict(keep_vars=True).items()} == shapes
    assert {k: v.shape for k, v in got.named_buffers()} == {
        k: v.shape for k, v in want.named_buffers()}
    assert all(t.is_meta for t in [*got.parameters(), *got.buffers()])
