"""Training parallelism on a GPU (NCCL, one rank): pipeline, DDP and ZeRO-3 keep their
single-process results with CUDA tensors (buffers, flat shards and headers on the device).

Run on the GPU machine: python -m pytest tests/layer5/test_training_gpu.py -m gpu -q
"""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as L5
from layer5_parallel import train_adapter as A


def _gpu_rank(device: str = "cuda") -> dict:
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    config = A.tiny_config(layers=3, hidden=64, heads=4, kv_heads=2, vocab=96, ffn=136)
    ids, targets = (t.to(dev) for t in A.random_batch(config, batch=5, seq_len=7, seed=0))
    ref = A.build_model(config, seed=1).to(dev)
    A.full_loss(ref, ids, targets).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    model = A.build_model(config, seed=1).to(dev)
    L5.pipeline_step(model, ids, targets, micro_batches=3)
    out["pipeline"] = max((p.grad - ref_grads[n]).abs().max().item()
                          for n, p in model.named_parameters())
    model = A.build_model(config, seed=1).to(dev)
    ddp = L5.DistributedDataParallel(model, bucket_bytes=20_000)
    A.full_loss(model, ids, targets).backward()
    ddp.finish_gradients()
    out["ddp"] = max((p.grad - ref_grads[n]).abs().max().item()
                     for n, p in model.named_parameters())
    ddp.close()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_opt.step()
    trainer = L5.ZeroTrainer(A.build_model(config, seed=1).to(dev), 3, lr=1e-2)
    trainer.step(ids, targets, ids.numel())
    for unit in trainer.units:
        unit.gather()
    out["zero3"] = max((p - dict(ref.named_parameters())[n]).abs().max().item()
                       for n, p in trainer.model.named_parameters())
    return out


@pytest.mark.gpu
def test_training_parallelism_on_cuda():
    (out,) = L5.engine.executor.comm.launch(_gpu_rank, 1, backend="nccl", timeout_s=180)
    assert out["pipeline"] < 1e-5 and out["ddp"] < 1e-5 and out["zero3"] < 1e-5, out
