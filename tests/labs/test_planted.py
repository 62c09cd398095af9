"""Planted submissions: wrong code written as a careful student (or a cheater) would write it,
graded as `stack grade --lab N --submission F` grades. Each must lose the points of what it
gets wrong and keep the rest (the same file's correct functions), so these tests show both
that the grader catches the bug and that the import guard leaves correct code alone.

* Bypasses: code that reaches the answer key instead of computing (importlib, __import__,
  sys.modules, an import string exec'd, the reference's file read and exec'd, a callback's
  __globals__): every graded function refused.
* Bugs the graders once let through: a softmax / log-sum-exp without the max subtracted
  (lab 5), the last matching stop string winning instead of the longest hold (lab 6), only
  messages[0] kept as the system prompt, token counts summed message by message (lab 7),
  and (lab 1, on this machine's Triton) RMSNorm normalising the unrounded fp16 residual sum.
* Robustness: a lab-5 rank check that hangs fails alone, on its own time budget.
The gradings run in conftest's pool beside the starter and reference gradings; each grades
only the lab's tests the plant concerns.
"""
from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from layer7_app.grading import available_labs, grade_lab

from .references import import_reference


def _answer_key(reference: str, function: str) -> Path:
    """The file that defines the reference's `function` (wherever the lab keeps it)."""
    return Path(inspect.getsourcefile(getattr(import_reference(reference), function)))


def _with(base: str, *functions: str) -> str:
    """base's source with these definitions appended (a later def replaces an earlier one)."""
    return base + "\n\n" + "\n\n".join(textwrap.dedent(f).strip() + "\n" for f in functions)


def _starter(lab: int) -> str:
    return available_labs()[lab].exercises.read_text()


# ---------------------------------------------------------------- the planted files
def lab6_bypasses() -> str:
    return _with(_answer_key("lab6_reference", "safe_length").read_text(), '''
        def safe_length(text, stops):
            import importlib
            return importlib.import_module("lab6_reference").safe_length(text, stops)
    ''', '''
        def sse_frames(items):
            yield from __import__("lab6_reference").sse_frames(items)
    ''', '''
        def admit(waiting, **kw):
            import sys
            return sys.modules["lab6_reference"].admit(waiting, **kw)
    ''')


def lab7_bypasses() -> str:
    key = _answer_key("lab7_reference", "fit_history")
    return _with(key.read_text(), '''
        def prefix_key(messages, chars=256):
            ns = {}
            exec("import lab7_reference as answers", ns)
            return ns["answers"].prefix_key(messages, chars)
    ''', f'''
        def choose_replica(key, in_flight, load_bound=4):
            ns = {{}}
            exec(open({str(key)!r}).read(), ns)  # the answer key's own file
            return ns["choose_replica"](key, in_flight, load_bound)
    ''', '''
        def fit_history(messages, count_tokens, context_len, max_tokens):
            g = count_tokens.__globals__  # the grader's module, if the callback was defined there
            answers = g.get("ref") or g["__builtins__"].__import__(
                "lab7_reference", fromlist=["fit_history"])
            return answers.fit_history(messages, count_tokens, context_len, max_tokens)
    ''')


def lab6_last_stop_wins() -> str:
    return _with(_answer_key("lab6_reference", "safe_length").read_text(), '''
        def safe_length(text, stops):
            hold = 0
            for stop in stops:  # each stop that matches replaces the hold: the last one wins
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        hold = k
                        break
            return len(text) - hold
    ''')


_FIT = '''
    def fit_history(messages, count_tokens, context_len, max_tokens):
        {system}
        rest = list(messages[len(system):])
        budget = context_len - max_tokens
        best = None
        for start in range(len(rest) - 1, -1, -1):
            if rest[start]["role"] != "user":
                continue
            if {cost} > budget:
                break
            best = start
        if best is None:
            raise ValueError("does not fit")
        return system + rest[best:]
'''


def lab7_first_system_only() -> str:
    return _with(_answer_key("lab7_reference", "fit_history").read_text(), _FIT.format(
        system='system = list(messages[:1]) if messages and messages[0]["role"] == "system" '
               'else []',
        cost="count_tokens(system + rest[start:])"))


def lab7_summed_counts() -> str:
    return _with(_answer_key("lab7_reference", "fit_history").read_text(), _FIT.format(
        system='system = []\n'
               '        while len(system) < len(messages) and '
               'messages[len(system)]["role"] == "system":\n'
               '            system.append(messages[len(system)])',
        cost="sum(count_tokens([m]) for m in system + rest[start:])"))


_ATTENTION = '''
    def attention_block(q, k, v, q_pos, k_pos, scale=None, causal=True):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = q.float() @ k.float().transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if causal:
            s = s.masked_fill(k_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
        {softmax}
        return torch.where(z > 0, e / z.clamp_min(1e-30), 0.0) @ v.float(), lse
'''
_MERGE = '''
    def merge_partial(out, lse, block_out, block_lse):
        {merge}
        a = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
        b = torch.exp(block_lse - new).nan_to_num(0.0).unsqueeze(-1)
        return a * out + b * block_out, new
'''


_TENSOR_PARALLEL = '''
    class CopyToTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            {backward}
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad


    class ReduceFromTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.clone()
            dist.all_reduce(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad


    def column_parallel_linear(x, weight, bias=None):
        return torch.nn.functional.linear(copy_to_tp_region(x), weight, bias)


    def row_parallel_linear(x, weight, bias=None):
        y = reduce_from_tp_region(torch.nn.functional.linear(x, weight))
        return y if bias is None else y + bias
'''


def lab5_one_check_hangs_no_max_subtracted() -> str:
    """Exercise 1 right, but f's backward hangs on one shape (the f check's): that
    check must fail on its time budget while the four after it pass in a fresh launch.
    Exercise 2 without the max subtracted: right at unit scores, NaN or inf at large ones."""
    return _with(_starter(5), _TENSOR_PARALLEL.format(backward=(
        "if tuple(grad.shape) == (4, 7):  # a hang on one input only, waiting as a rank\n"
        "                import time  # deadlocked in a collective does (burning no CPU)\n"
        "                time.sleep(10 ** 6)")), _ATTENTION.format(softmax=(
            "e = torch.exp(s)  # no max subtracted: exp overflows for scores above ~88\n"
            "        z = e.sum(-1, keepdim=True)\n"
            "        lse = torch.log(z).squeeze(-1)")), _MERGE.format(merge=(
                "new = torch.log(torch.exp(lse) + torch.exp(block_lse))  # no max either")))


def lab1_unrounded_residual() -> str:
    """Lab 1's RMSNorm as the reference writes it, but normalising the fp32 sum x + r where
    the residual stream h it returns (and the next layer reads) is that sum rounded to fp16."""
    return _with(_starter(1), '''
        @triton.jit
        def _planted_rms_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n, eps,
                                HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            mask = cols < n
            x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                x += tl.load(r_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(h_ptr + row * n + cols, x.to(h_ptr.dtype.element_ty), mask=mask)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty),
                     mask=mask)
    ''', '''
        def rms_norm(x, weight, eps=1e-6, residual=None, impl="triton"):
            shape, n = x.shape, x.shape[-1]
            x2 = x.reshape(-1, n).contiguous()
            r2 = residual.reshape(-1, n).contiguous() if residual is not None else x2
            y, h = torch.empty_like(x2), torch.empty_like(x2)
            _planted_rms_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), y, h, n, eps,
                                                HAS_RES=residual is not None,
                                                BLOCK=triton.next_power_of_2(n))
            if residual is None:
                return y.reshape(shape)
            return y.reshape(shape), h.reshape(shape)
    ''')


# lab, planted file, the -k selection graded, the tests that must fail ("name?": may fail,
# as the bug shows on some draws only); every other selected test must pass
PLANTS = {
    "lab5_one_check_hangs_no_max_subtracted": (
        5, lab5_one_check_hangs_no_max_subtracted, None,
        {"test_tensor_parallel[f_copy_to_tp_region]", "test_attention_block_without_mask",
         "test_attention_block_causal_and_empty_rows", "test_attention_block_gqa",
         "test_merge_partial"}),
    "lab1_unrounded_residual": (1, lab1_unrounded_residual, "rms_norm",
                                {"test_rms_norm_fused_residual"}),
    "lab6_bypasses": (6, lab6_bypasses, None, "all"),
    "lab7_bypasses": (7, lab7_bypasses, None, "all"),
    "lab6_last_stop_wins": (6, lab6_last_stop_wins, None,
                            {"test_safe_length_hand_cases", "test_safe_length_random"}),
    "lab7_first_system_only": (7, lab7_first_system_only, "fit_history",
                               {"test_fit_history_hand_cases",
                                "test_fit_history_random_matches_a_brute_force_oracle",
                                "test_fit_history_with_the_course_tokenizer?"}),
    "lab7_summed_counts": (7, lab7_summed_counts, "fit_history",
                           {"test_fit_history_hand_cases",
                            "test_fit_history_random_matches_a_brute_force_oracle"}),
}


SLOW = {"lab5_one_check_hangs_no_max_subtracted", "lab1_unrounded_residual"}
#: for the plant with a hanging rank check: its budget 8 s, not 30 (the hang is certain)
PLANT_ENV = {"LLM_STACK_LAB5_CHECK_LIMIT_S": "8"}


def grading_job(item: pytest.Item, tmp_path_factory: pytest.TempPathFactory):
    """One plant's grading, for conftest's pooled_gradings (which runs it beside the other
    plants'): the slow plants first, the quick ones last."""
    if getattr(item, "originalname", None) != PLANTED_TEST:
        return None
    name = item.callspec.params["name"]
    lab, source, select, _ = PLANTS[name]

    def run():
        path = tmp_path_factory.mktemp(name) / "exercises.py"
        path.write_text(source())
        return grade_lab(lab, submission=path, select=select, env=PLANT_ENV)

    return ("planted", name), (True, name not in SLOW, -1), run


PLANTED_TEST = "test_a_planted_submission_loses_exactly_its_points"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", PLANTS)
def test_a_planted_submission_loses_exactly_its_points(name, pooled_gradings):
    report = pooled_gradings["planted", name]
    if isinstance(report, Exception):
        raise report
    _, _, _, must_fail = PLANTS[name]
    status = {t.name: t for t in report.tests}
    assert status, "nothing was graded"
    failing = set(status) if must_fail == "all" else {n for n in must_fail if n[-1] != "?"}
    either = {n[:-1] for n in must_fail if n[-1] == "?"}  # may lose, depending on the draw
    assert failing | either <= set(status), f"not graded: {sorted(failing - set(status))}"
    kept = [n for n in failing if status[n].status == "passed"]
    assert not kept, f"{name} kept the points of {kept}: the grader did not catch it"
    lost = [f"{n}: {status[n].output[:300]}" for n in set(status) - failing - either
            if status[n].status != "passed"]
    assert not lost, f"{name} lost points it did not deserve to lose:\n" + "\n".join(lost)
    if name.endswith("bypasses"):  # each refusal says what happened
        text = "\n".join(t.output for t in report.tests)
        assert re.search(r"the grader refuses|KeyError", text), text[:2000]


GUARD_PROBE = '''
import json, sys
from tests.labs.references import import_reference
ref = import_reference("lab7_reference")  # the grader holds the reference, as a test module does
from tests.labs.submission_guard import load_submission
ex = load_submission(sys.argv[1])
out = {}
for name in ("caller_frame", "heap", "stack", "modules", "own_work"):
    try:
        out[name] = repr(getattr(ex, name)())
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


def test_the_guard_refuses_introspection_and_leaves_honest_code_alone(tmp_path):
    """In a process of its own (the guard stays installed once loaded): a submission that
    walks to its caller's frame, the heap or the grader's modules gets nothing; plain code
    runs."""
    submission = tmp_path / "exercises.py"
    submission.write_text(textwrap.dedent('''
        import gc, inspect, sys

        def caller_frame():
            return sys._getframe(1).f_globals["ref"]

        def heap():
            return [m for m in gc.get_objects() if getattr(m, "__name__", "") == "layer7_app"]

        def stack():
            return inspect.stack()[1].frame.f_globals["ref"]

        def modules():
            return sys.modules["lab7_reference"]

        def own_work():
            return sorted({len(w) for w in "to be or not to be".split()})
    '''))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", GUARD_PROBE, str(submission)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for name in ("caller_frame", "heap", "stack"):
        assert out[name].startswith("RuntimeError: the grader refuses"), (name, out[name])
    assert out["modules"].startswith("KeyError"), out["modules"]
    assert out["own_work"] == "[2, 3]"
