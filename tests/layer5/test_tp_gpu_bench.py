"""The TP GPU benchmark's reporting, on made-up rows (the timing itself needs GPUs): the first
position where greedy tokens differ, the table, and the tokens/s-vs-GPUs plot with its ideal
line."""
from __future__ import annotations

import math

from layer5_parallel.bench.tp_gpu_bench import first_difference, format_rows, plot


def test_first_difference_is_the_earliest_over_all_sequences():
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 6]]) == 1


def test_table_and_plot(tmp_path):
    rows = [dict(shape="llama-3.1-8b", tp=tp, batch=b, new_tokens=64, tp_backend="torch",
                 decode_tok_s=100.0 * b * tp ** 0.8, step_ms=5.0 / tp, steps=64,
                 predicted_step_ms=4.0 / tp, host_ms_per_step=0.2, same_tokens=tp == 1,
                 first_difference=None if tp == 1 else 40, speedup=tp ** 0.8, host_vs_tp1=1.0)
            for b in (1, 32) for tp in (1, 2)]
    rows.append(dict(rows[1], tp_backend="ours", decode_tok_s=math.nan))
    text = format_rows(rows)
    assert "llama-3.1-8b" in text and " 40" in text and "ours" in text
    plot(rows[:4] + [dict(rows[1], tp_backend="ours", decode_tok_s=150.0)], tmp_path / "tp.png")
    assert (tmp_path / "tp.png").stat().st_size > 10_000


def test_bad_arguments_are_one_line_each():
    import pytest  # noqa: PLC0415

    from layer5_parallel.bench import dp, tp_gpu_bench  # noqa: PLC0415

    for main, argv in ((tp_gpu_bench.main, ["--shapes", "llama-9"]), (dp.main, ["--dp", "0"]),
                       (dp.main, ["--max-out", "-3"]),
                       (tp_gpu_bench.main, ["--switches", "pdl+turbo"])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_host_clock_and_step_phases_on_gloo():
    """The bench's host measurements and rank 0's step by phase, on a TP=2 gloo engine with
    async scheduling and the decode-graph runner (eager on a CPU): the figures are there and
    add up, and every wrapped call is put back."""
    import torch  # noqa: PLC0415

    from layer5_parallel import LLM  # noqa: PLC0415
    from layer5_parallel.bench import step_phases, tp_gpu_bench  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (12,), generator=g).tolist() for _ in range(3)]
    with LLM(step_phases.tiny_model(), tensor_parallel_size=2, cuda_graph=True,
             async_scheduling=True, num_blocks=32, block_size=16, max_num_seqs=4,
             tp_timeout_s=60.0) as llm:
        ref = tp_gpu_bench._generate(llm, prompts, 8)[1]
        r = tp_gpu_bench.measure(llm, prompts, 8, 1)
        assert r["tokens"] == ref
        # decode-only figures: differences of two runs, either sign on a few CPU steps
        assert r["steps"] == 8 and math.isfinite(r["host_ms_per_step"])
        assert math.isfinite(r["host_cpu_ms_per_step"]) and r["host_ms_per_step_all"] > 0
        s = step_phases.phase_run(llm, lambda: tp_gpu_bench._generate(llm, prompts, 8))
        assert s["steps"] >= 5, s
        assert {"schedule", "context", "ring put", "graph launch", "sampling launch",
                "read tokens", "postprocess", "outputs", "other"} <= set(s["phases"]), s
        assert abs(sum(w for w, _ in s["phases"].values()) - s["step_us"]) < 1e-6
        assert 0 < s["host_us"] <= s["step_us"] and 0 < s["host_cpu_us"] <= s["cpu_us"]
        text = step_phases.format_summary(s)
        assert "ring put" in text and "host = step - waits" in text
        # nothing left wrapped: the engine runs its own methods again
        assert "step" not in vars(llm) and "_complete" not in vars(llm)
        assert "execute" not in vars(llm.runner) and "run" not in vars(llm.runner.graph)
        assert "_wait" not in vars(llm.tp_group.ring) and "send" not in vars(llm.tp_group)
        assert tp_gpu_bench._generate(llm, prompts, 8)[1] == ref


def test_bench_shape_runs_on_a_cpu_with_phases_probe_and_spin_layouts():
    """The GPU bench's own loop over layouts (as the GPU call runs it), on a tiny shape on the
    CPU over gloo: the rows carry the decode-only host figures, the phases and the CPU probe;
    a layout with its own worker spin is labelled, and the runtime's spin is put back."""
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from layer5_parallel.bench import step_phases, tp_gpu_bench  # noqa: PLC0415
    from layer5_parallel.runtime import group  # noqa: PLC0415

    spins, affinity, pause = dict(group.SPIN_S), os.sched_getaffinity(0), group.SPIN_PAUSE_S
    config = step_phases.tiny_model().config
    lines = []
    rows = tp_gpu_bench.bench_shape(
        "tiny", [(1, "torch"), (2, "torch"), (2, "torch", 0.01), (2, "torch", None, True),
                 (2, "torch", None, False, 0.0)],
        repeats=1, backend="torch", workloads=((1, 6), (3, 6)), config=config, device="cpu",
        dtype=torch.float32, log=lines.append)
    assert group.SPIN_S == spins and os.sched_getaffinity(0) == affinity
    assert group.SPIN_PAUSE_S == pause
    assert [(r["tp"], r["batch"], r["layout"]) for r in rows] == [
        (1, 1, "torch"), (1, 3, "torch"), (2, 1, "torch"), (2, 3, "torch"),
        (2, 1, "torch@0.01s"), (2, 3, "torch@0.01s"), (2, 1, "torch+pin"), (2, 3, "torch+pin"),
        (2, 1, "torch/0us"), (2, 3, "torch/0us")]
    assert [r["pinned_cpus"] is not None for r in rows] == [False] * 6 + [True] * 2 + [False] * 2
    assert [r["worker_pause_s"] for r in rows[8:]] == [0.0, 0.0]
    assert rows[2]["worker_pause_s"] == group.SPIN_PAUSE_S
    assert any("pinned to cpus" in line for line in lines)
    for r in rows:
        assert r["same_tokens"], r
        # (the decode-only figures are differences of two runs: only their presence is
        # checked here, a few CPU steps on a shared machine may come out either way)
        assert r["phases"]["steps"] >= 3 and r["phases"]["host_cpu_us"] > 0
        assert math.isfinite(r["host_cpu_ms_per_step"]) and math.isfinite(r["host_ms_per_step"])
        assert r["cpu_probe"]["probe_us_workers_napping"] > 0
        assert (r["worker_spin_s"] is None) == (r["tp"] == 1)
    assert rows[4]["worker_spin_s"] == 0.01
    assert len(rows[2]["cpu_probe"]["worker_cpus"]) == 1
    assert len(rows[2]["cpu_probe"]["worker_cpu_while_spinning"]) == 1
    assert isinstance(rows[2]["cpu_probe"]["workers_on_rank0_core"], list)
    assert any("ring put" in line for line in lines)
    text = tp_gpu_bench.format_rows(rows)
    assert "torch@0.01s" in text and "cpu ms" in text


def test_cpu_sets_read_and_written_as_linux_writes_them():
    from layer5_parallel.bench.step_phases import _cpus, _parse_cpus  # noqa: PLC0415

    assert _parse_cpus("0-3,8") == {0, 1, 2, 3, 8} and _parse_cpus("5") == {5}
    assert _cpus({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_decode_switches_are_set_for_an_engine_and_put_back(monkeypatch):
    """--switches: the named ones on, the others off, as environment for the workers and as
    rank 0's PeerAllReduce class attributes, for one engine's life; 'default' touches nothing."""
    import os  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    from layer5_parallel.bench import tp_gpu_bench as B  # noqa: PLC0415

    assert B.parse_switches("default") is None
    assert B.parse_switches("off") == frozenset()
    assert B.parse_switches("pdl+ll") == {"pdl", "ll"}
    for bad in ("", "pdl+", "fast"):
        with pytest.raises(ValueError, match="switches"):
            B.parse_switches(bad)
    peer = B._PEER
    monkeypatch.setenv(peer.PDL_ENV, "1")
    monkeypatch.delenv(peer.LL_ENV, raising=False)
    before = {a: getattr(peer, a) for a in ("pdl", "low_latency")}
    with B.switched(B.parse_switches("ll+norms")):
        assert os.environ[peer.LL_ENV] == "1" and os.environ[peer.PDL_ENV] == "0"
        assert os.environ[B.FUSED_NORMS_ENV] == "1"
        assert peer.low_latency and not peer.pdl
    assert os.environ[peer.PDL_ENV] == "1" and peer.LL_ENV not in os.environ
    assert {a: getattr(peer, a) for a in before} == before
    before = peer.gemv_send
    with B.switched(B.parse_switches("pdl+send")):
        assert os.environ[peer.GEMV_SEND_ENV] == "1"
        assert peer.gemv_send and not peer.low_latency
    with B.switched(B.parse_switches("pdl")):  # the send is on by default: "off" turns it off
        assert os.environ[peer.GEMV_SEND_ENV] == "0" and not peer.gemv_send
    assert peer.gemv_send == before
    with B.switched(None):
        assert os.environ[peer.PDL_ENV] == "1"
