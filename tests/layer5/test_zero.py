"""ZeRO-1/2/3 and activation checkpointing: same loss curve and weights as one process with
Adam on the full batch; per-rank bytes of parameters, gradients and optimizer state equal
to ZeRO's formulas; checkpointing keeps gradients and shrinks saved activations.

One launch (world 2) runs every stage for a few Adam steps on uneven batch slices.
"""
from __future__ import annotations

import pytest
import torch

import layer5_parallel as L5
from layer5_parallel import train_adapter as A

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

STEPS = 3


def _config():
    # every unit's size is even, so shards need no padding and bytes == formula exactly
    return A.tiny_config(layers=2, hidden=32, heads=4, kv_heads=2, vocab=50, ffn=44)


def _batches(config):
    return [A.random_batch(config, batch=5, seq_len=6, seed=100 + s) for s in range(STEPS)]


def _reference() -> tuple[list[float], dict]:
    config = _config()
    model = A.build_model(config, seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for ids, targets in _batches(config):
        loss = A.full_loss(model, ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_zero() -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_losses, ref_params = _reference()
    out = {"ref": ref_losses}
    for stage in (0, 1, 2, 3):
        model = A.build_model(_config(), seed=7)
        trainer = L5.ZeroTrainer(model, stage, lr=1e-2)
        losses = []
        for ids, targets in _batches(_config()):
            mine = ids.tensor_split(world)[rank], targets.tensor_split(world)[rank]  # 3 + 2 rows
            losses.append(trainer.step(*mine, ids.numel()))
        if stage == 3:  # gather the shards to compare the weights
            for unit in trainer.units:
                unit.gather()
        err = max((p - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
        row = trainer.memory_row()
        out[stage] = dict(losses=losses, weight_err=err, psi=trainer.psi, params=row.params,
                          grads=row.grads, optimizer=row.optimizer, activations=row.activations,
                          formula=row.formula, peak_grads=trainer.peak_grad_bytes)
    return out


@pytest.fixture(scope="module")
def ranks():
    return L5.engine.executor.comm.launch(_rank_zero, 2, backend="gloo", timeout_s=240)


def test_loss_curves_and_weights_match_unsharded(ranks):
    for result in ranks:
        for stage in (0, 1, 2, 3):
            assert result[stage]["losses"] == pytest.approx(result["ref"], abs=1e-5), stage
            assert result[stage]["weight_err"] < 1e-5, (stage, result[stage]["weight_err"])


def test_memory_equals_formula(ranks):
    psi = A.build_model(_config()).num_parameters() if hasattr(A.build_model(_config()),
                                                                "num_parameters") else None
    for result in ranks:
        for stage in (0, 1, 2, 3):
            r = result[stage]
            if psi is not None:
                assert r["psi"] == psi  # no padding at these sizes
            formula = L5.zero_formula(stage, r["psi"], 2)
            assert formula == r["formula"]
            assert (r["params"], r["grads"], r["optimizer"]) == \
                (formula["params"], formula["grads"], formula["optimizer"]), (stage, r)
        # ZeRO-2 reduce-scatters each unit inside backward: whole gradients never all coexist
        assert result[2]["peak_grads"] < result[0]["peak_grads"] == 4 * result[0]["psi"]
        # ZeRO-3 frees the gathered weights: the activations it saved are the same as DDP's
        assert result[3]["activations"] == result[0]["activations"]


def test_formula_and_table():
    f = L5.zero_formula(2, 1000, 4, (2, 2, 12))  # the paper's mixed-precision numbers
    assert f == {"params": 2000, "grads": 500, "optimizer": 3000}
    assert sum(L5.zero_formula(0, 1000, 4, (2, 2, 12)).values()) == 16 * 1000
    with pytest.raises(ValueError, match="stage"):
        L5.zero_formula(4, 1000, 4)
    row = L5.MemoryRow("x", 1024, 2048, 0, 512, L5.zero_formula(1, 256, 2))
    assert "x" in L5.format_table([row]) and "KiB" in L5.format_table([row])


def test_checkpointing_same_gradients_less_memory():
    config = A.tiny_config(layers=3, hidden=32, heads=4, kv_heads=2, vocab=50, ffn=44)
    model = A.build_model(config, seed=1)
    ids, targets = A.random_batch(config, batch=3, seq_len=5, seed=2)
    params = lambda: list(model.parameters())  # noqa: E731
    with L5.ActivationMeter(params) as plain:
        loss = A.full_loss(model, ids, targets)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with L5.ActivationMeter(params) as ckpt:
        loss2 = L5.checkpointed_loss(model, ids, targets)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert ckpt.bytes < plain.bytes / 2
    with pytest.raises(ValueError, match="every"):
        L5.checkpointed_loss(model, ids, targets, every=0)


def test_bench_rows_format():
    rows = [dict(part="zero", label="ZeRO-1", params=4096, grads=4096, optimizer=2048,
                 activations=1024, formula=L5.zero_formula(1, 1024, 4)),
            dict(part="checkpointing", checkpointed=False, activations=1024),
            dict(part="checkpointing", checkpointed=True, activations=256),
            dict(part="pipeline", schedule="1f1b", stages=2, micro_batches=4, idle_measured=0.25,
                 idle_per_rank=[0.2, 0.3], idle_formula=0.2, step_ms=10.0)]
    text = L5.format_training(rows)
    assert "ZeRO-1" in text and "1F1B" in text and "formula 20%" in text
    assert "DDP + checkpointing" not in L5.zero_table(rows)  # no DDP row to base it on
