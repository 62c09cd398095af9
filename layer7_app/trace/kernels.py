"""The kernels of the traced request, from the torch.profiler session on the engine thread.

On a CPU the "kernels" are ATen operators (matmul, softmax, ...); on a GPU each launches one
or more device kernels. Counted here: the operators called directly by a model forward
(their time includes whatever they call: that is the time spent below layer 3), and the
leaf operators under it (the ones that do the work: a proxy for kernel launches).
"""
from __future__ import annotations

from collections import Counter

from .hooks import FORWARD
from .spans import Recorder


def kernel_spans(profile, forward_starts: list[float], recorder: Recorder) -> dict:
    """Add one layer-1 span per operator called by a forward; returns {time_s, leaf_ops,
    top_ops: [(name, calls, seconds)]}. Profiler times are aligned to perf_counter through
    the forwards (record_function ranges) whose perf_counter starts the probe recorded."""
    events = list(profile.events())
    forwards = sorted((e for e in events if e.name == FORWARD), key=lambda e: e.time_range.start)
    if not forwards or not forward_starts:
        return {"time_s": 0.0, "leaf_ops": 0, "top_ops": []}
    shift = min(forward_starts) - forwards[0].time_range.start / 1e6
    total, leaves, per_op = 0.0, 0, Counter()
    calls = Counter()
    for fwd in forwards:
        for op in fwd.cpu_children:
            start = op.time_range.start / 1e6 + shift
            dur = (op.time_range.end - op.time_range.start) / 1e6
            recorder.add(op.name, 1, start, start + dur)
            total += dur
            per_op[op.name] += dur
            calls[op.name] += 1
        stack = list(fwd.cpu_children)
        while stack:
            e = stack.pop()
            if e.cpu_children:
                stack.extend(e.cpu_children)
            else:
                leaves += 1
    top = [(name, calls[name], t) for name, t in per_op.most_common(8)]
    return {"time_s": total, "leaf_ops": leaves, "top_ops": top}
