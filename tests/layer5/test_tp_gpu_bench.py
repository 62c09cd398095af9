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
                       (dp.main, ["--max-out", "-3"])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
