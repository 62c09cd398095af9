"""Data parallelism for serving: `LLM(..., data_parallel_size=2)` equals one engine.

Two replica processes on the CPU, each a whole engine over its share of the prompts; their
greedy outputs, put back in prompt order, equal one engine's — through `generate` and
through the online loop (`add_request` / `step`, each request to the least-loaded replica).
Bad sizes get one clear error.
"""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import layer5_parallel as l5
from layer5_parallel.data_parallel.replicas import (
    deal,
    replica_devices,
    visible_devices,
)
from layer5_parallel.runtime.environ import environ

from .test_pp_engine import random_config

l3 = l5.engine.executor
ENGINE = dict(num_blocks=64, block_size=4, max_num_seqs=8)


def prompts(n: int = 7, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 211, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 14, (n,), generator=g)]


@pytest.fixture(scope="module")
def model() -> l3.Model:
    return l3.Model(l3.random_model(random_config(), seed=2, std=0.3))


def test_dp2_equals_one_engine_offline_and_online(model):
    ps = prompts()
    params = l5.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in l5.LLM(model, **ENGINE).generate(ps, params)]
    with l5.LLM(model, data_parallel_size=2, **ENGINE) as dp:
        assert isinstance(dp, l5.ReplicaSet) and dp.devices == ["cpu", "cpu"]
        got = dp.generate(ps, params)
        assert [o.outputs[0].token_ids for o in got] == want
        assert set(dp.replica_seconds) == {0, 1}  # both replicas ran a share
        ids = [dp.add_request(p, params) for p in ps]
        assert sorted(dp.load) == [3, 4]  # least-loaded first: 4 + 3
        done = {}
        for _ in range(100):
            for o in dp.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            if not dp.has_unfinished():
                break
        assert [done[i] for i in ids] == want
        with pytest.raises(AttributeError, match="stack serve --dp N"):
            dp.tokenizer  # noqa: B018 (what layer 6 would ask an engine for)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replica")]


def test_dealing_and_bad_sizes():
    hands = deal([1000] + [100] * 10, 2)  # the long request alone; the ten short ones
    assert hands == [[0], list(range(1, 11))]
    hands = deal([5, 1, 4, 2, 3, 3], 3)  # every index once, sums 6 / 6 / 6
    assert sorted(k for h in hands for k in h) == list(range(6))
    assert sorted(sum([5, 1, 4, 2, 3, 3][k] for k in h) for h in hands) == [6, 6, 6]
    assert deal([1], 2) == [[0], []]
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        l5.EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="dp_devices names 1 devices"):
        l5.EngineConfig(data_parallel_size=2, dp_devices=("cpu",))
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs 64 GPUs"):
            replica_devices(l5.EngineConfig(data_parallel_size=32, tensor_parallel_size=2,
                                            device="cuda"))


def test_more_replicas_than_gpus_is_one_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = l5.EngineConfig(data_parallel_size=4)
    with pytest.raises(ValueError, match=r"data_parallel_size=4 x 1 rank\(s\) per replica needs "
                                         r"4 GPUs; 2 are visible"):
        replica_devices(config)
    assert replica_devices(l5.EngineConfig(data_parallel_size=2)) == ["0", "1"]
    assert replica_devices(l5.EngineConfig(data_parallel_size=1, tensor_parallel_size=2,
                                           pipeline_parallel_size=1)) == ["0,1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert replica_devices(config) == ["cpu"] * 4  # no GPUs: replicas share the CPU


def _report_mask(q) -> None:
    import os  # noqa: PLC0415 - in the spawned child
    q.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_a_replica_starts_with_its_gpu_mask_in_place(monkeypatch):
    """The mask must be in the child's environment from its start (set inside the child, it
    came too late: unpickling the arguments had already asked CUDA for its devices, and two
    replicas landed on GPU 0); through the parent's own mask; the parent's env unchanged."""
    assert visible_devices("1", None) == "1"
    assert visible_devices("0,1", "4,6,7") == "4,6"
    assert visible_devices("2", " 3, 5,7 ") == "7"
    with pytest.raises(ValueError, match="sees 2 GPU"):
        visible_devices("2", "5,6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_report_mask, args=(q,))
    with environ(CUDA_VISIBLE_DEVICES=visible_devices("1", "5,6")):
        child.start()
    assert q.get(timeout=60) == "6"
    child.join(30)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
