"""The shipped course models: they load with our executor and with transformers alike,
and write play-form text; `stack run --layer 3` and the bench helpers work on a CPU."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import layer3_model as l3
from layer3_model import bench, commands

PROMPT = "HAMLET.\nTo be, or not to be, that is the question.\n\nHORATIO.\n"


@pytest.mark.parametrize("size", l3.COURSE_MODEL_SIZES)
def test_course_model_agrees_with_transformers(size):
    tf = pytest.importorskip("transformers")
    path = l3.course_model_dir(size)
    ours = l3.load(path, device="cpu", dtype="float32")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = ours.encode(PROMPT)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
        mine = ours.net.causal_lm_logits(torch.tensor([ids]))[0]
    torch.testing.assert_close(mine, ref, atol=2e-4, rtol=1e-4)
    params = l3.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):]
    assert ours.generate_outputs([ids], params)[0].token_ids == greedy.tolist()


def test_course_target_writes_play_form_and_beats_the_draft():
    target = l3.load(l3.course_model_dir("target"), device="cpu")
    cfg = json.loads((l3.course_model_dir("target") / "config.json").read_text())
    assert 8e6 <= sum(p.numel() for p in target.net.parameters()) <= 15e6 and cfg["model_type"] == "llama"
    text = target.generate([PROMPT], l3.SamplingParams(temperature=0.7, top_k=40, seed=3, max_tokens=80))[0]
    speakers = [line for line in text.split("\n") if line.isupper() and line.endswith(".")]
    assert speakers, f"no SPEAKER. line in {text!r}"
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)
    # held-out text (Hamlet is a training play, but this checks the models are not random)
    ids = target.encode(PROMPT * 3)
    ppl_target = l3.perplexity(target, ids)
    ppl_draft = l3.perplexity(l3.load(l3.course_model_dir("draft"), device="cpu"), ids)
    assert ppl_target < 200 and ppl_target < ppl_draft * 1.5, (ppl_target, ppl_draft)


def test_missing_course_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_STACK_MODELS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="course model 'draft' not found"):
        l3.course_model_dir("draft")
    with pytest.raises(ValueError, match="unknown course model"):
        l3.course_model_dir("huge")


def test_stack_run_layer3_streams_a_scene(capsys):
    assert commands.run(["--max-tokens", "20", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert commands.PROMPT in out and "20 tokens in" in out and "decode" in out
    assert len(out.split(commands.PROMPT, 1)[1].split("20 tokens in")[0].strip()) > 20  # the continuation


def test_bench_arithmetic_on_a_small_model():
    cfg = l3.ModelConfig(model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=True)
    net = l3.random_model(cfg)
    n_params = sum(p.numel() for p in net.parameters())
    assert bench.weight_bytes_read(net) == 4 * n_params  # fp32, tied head counted once
    untied = l3.random_model(dataclasses.replace(cfg, tie_word_embeddings=False))
    n_untied = sum(p.numel() for p in untied.parameters())  # the lookup reads one row of embed
    read = n_untied - (cfg.vocab_size - 1) * cfg.hidden_size
    assert bench.weight_bytes_read(untied) == 4 * read
    norms = sum(p.numel() for n, p in net.named_parameters() if "norm" in n)
    assert bench.matmul_params(net) == n_params - norms - cfg.vocab_size * cfg.hidden_size
    assert bench.kv_bytes_per_position(net) == 2 * 3 * 2 * 8 * 4
    # attention FLOPs grow with T^2: doubling T more than doubles the total
    assert bench.prefill_flops(net, 64) > 2 * bench.prefill_flops(net, 32)
    assert 0 < bench.decode_seconds_per_token(net, prompt_len=5, new_tokens=4, cuda_graph=False) < 5
    assert 0 < bench.prefill_seconds(net, 17, repeats=2) < 5


def test_llama_3_2_1b_shape_has_its_parameter_count():
    from layer3_model.shapes import LLAMA_3_2_1B
    cfg = l3.ModelConfig.from_dict(LLAMA_3_2_1B)
    with torch.device("meta"):
        net = l3.LlamaModel(cfg)
    assert sum(p.numel() for p in net.parameters()) == pytest.approx(1.236e9, rel=1e-3)


def test_bench_perplexity_rows_compare_precisions(tmp_path):
    text = ("BRUTUS.\nPeace! count the clock.\n\nCASSIUS.\nThe clock hath stricken three.\n\n"
            "TREBONIUS.\n'Tis time to part.\n\n") * 8
    (tmp_path / "val.txt").write_text(text + "\n\n\n" + text)
    rows = commands._course_quality(tmp_path, 300)
    assert len(rows) == 2
    for line in rows.values():  # "fp32 a, bf16 b, W8A16 c (+x% vs bf16)"
        fp32, bf16, w8 = (float(part.split()[1].rstrip(",")) for part in line.split(", ")[:3])
        assert 1 < fp32 < 4096 and abs(bf16 / fp32 - 1) < 0.05 and abs(w8 / bf16 - 1) < 0.05
    assert commands._course_quality(tmp_path / "missing", 300) == {}  # no corpus: skipped, said so
