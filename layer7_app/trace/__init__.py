"""`stack trace`: one request followed from layer 7 down to the kernels.

spans.py (spans and the Chrome/Perfetto trace JSON), hooks.py (an ASGI middleware and the
engine probe that record them), kernels.py (torch.profiler's operators), table.py (time
per layer as a partition of the wall time), run.py (`trace_request`, `trace_main`).
"""
from .run import TraceResult, trace_main, trace_request
from .spans import LAYERS, Recorder, Span, chrome_trace
from .table import partition

__all__ = ["trace_request", "trace_main", "TraceResult", "Span", "Recorder", "chrome_trace",
           "LAYERS", "partition"]
