"""The executor's LlamaModel as a training model: model(ids (B, T)) with autograd, no cache.

Checked against transformers (loss, logits and every gradient, on tiny random Llama, Qwen2
and Mistral checkpoints at awkward sizes) and against this layer's own serving path; a
short training run must lower the loss; bad input is a ValueError.
"""
from __future__ import annotations

import copy

import pytest
import torch

import layer3_model as l3
from layer3_model.weights import ours_to_hf

pytestmark = pytest.mark.usefixtures("single_thread")
B, T = 3, 13  # T > the Mistral checkpoint's sliding window (6): the windowed path runs too


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _grads_hf_named(model: l3.LlamaModel) -> dict[str, torch.Tensor]:
    """Our gradients under HF names (merged q/k/v and gate/up split back apart)."""
    grads = copy.deepcopy(model)
    for p, g in zip(grads.parameters(), model.parameters(), strict=True):
        p.data = g.grad
    return ours_to_hf(grads)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-rope3", "qwen2-bias", "mistral-window"])
def test_training_forward_and_backward_match_transformers(make_checkpoint, name: str) -> None:
    path, hf = make_checkpoint(name)
    ours = l3.load_model(path, dtype=torch.float32).train()
    hf = copy.deepcopy(hf).float().train()  # the fixture's model is shared: keep its grads off it
    ids, targets = _batch(ours.config.vocab_size, seed=len(name))

    loss = ours.loss(ids, targets)
    loss.backward()
    logits_hf = hf(input_ids=ids).logits
    loss_hf = l3.causal_lm_loss(logits_hf, targets)
    loss_hf.backward()

    torch.testing.assert_close(ours(ids), logits_hf, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss, loss_hf, atol=1e-6, rtol=1e-5)
    ours_grads = _grads_hf_named(ours)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}  # a tied lm_head appears once
    assert set(ours_grads) == set(hf_grads)
    for n, g in hf_grads.items():
        torch.testing.assert_close(ours_grads[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_training_forward_equals_the_serving_path(make_checkpoint) -> None:
    path, _ = make_checkpoint("mistral-window")
    net = l3.load_model(path, dtype=torch.float32)
    ids, _ = _batch(net.config.vocab_size, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(net(ids), net.causal_lm_logits(ids), atol=2e-5, rtol=1e-4)
        # A pipeline stage's pieces compose to the whole forward.
        half = net.config.num_hidden_layers // 2
        x = net.causal_layers(net.embed_tokens(ids), slice(0, half))
        torch.testing.assert_close(net.head(net.causal_layers(x, slice(half, None))), net(ids))


def test_dropout_acts_in_train_mode_only() -> None:
    config = l3.COURSE_SIZES["tiny"]
    torch.manual_seed(0)
    net = l3.LlamaModel(config, dropout=0.3)
    ids, _ = _batch(config.vocab_size, seed=1)
    with torch.no_grad():
        net.eval()
        first, second = net(ids), net(ids)
        net.train()
        dropped = net(ids)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert (dropped - first).abs().max() > 1e-3


def test_short_training_run_lowers_the_loss() -> None:
    torch.manual_seed(0)
    net = l3.new_model("tiny", vocab_size=61, seq=T)
    ids, targets = _batch(61, seed=3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = net.loss(ids, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(61.0)).item(), abs=0.3)  # ~uniform
    assert losses[-1] < 0.5 * losses[0]


def test_bad_training_input_is_a_clear_error() -> None:
    net = l3.new_model("tiny", vocab_size=50, seq=8)
    with pytest.raises(ValueError, match="batch, seq"):
        net(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        net(torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="targets"):
        net.loss(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout"):
        l3.LlamaModel(net.config, dropout=1.0)
    net.set_backend("triton")
    with pytest.raises(ValueError, match="no backward"):
        net(torch.zeros(2, 8, dtype=torch.int64))


@pytest.mark.gpu
def test_training_step_on_gpu_in_bf16_matches_fp32(make_checkpoint) -> None:
    """On CUDA, SDPA takes a fused kernel and autocast runs the matmuls in bf16: the loss
    and gradients stay close to fp32 on the CPU, and every gradient is finite."""
    path, _ = make_checkpoint("llama-gqa")
    ref = l3.load_model(path, dtype=torch.float32).train()
    gpu = l3.load_model(path, dtype=torch.float32, device="cuda").train()
    ids, targets = _batch(ref.config.vocab_size, seed=11)
    ref.loss(ids, targets).backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu.loss(ids.cuda(), targets.cuda())
    loss.backward()
    torch.testing.assert_close(loss.cpu(), ref.loss(ids, targets).detach(), atol=0.05, rtol=0.02)
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p.grad).all(), name
        cos = torch.nn.functional.cosine_similarity(p.grad.cpu().flatten(), q.grad.flatten(), 0)
        assert cos > 0.98, (name, cos.item())
