"""What keeps a submission away from the answers: from the moment a student's file is loaded,
the layer packages (and the grader's own files) are out of its code's reach, however it asks.

`load_submission(path)` imports the file and, once per process, puts four things in place:

1. sys.modules: the layer packages, the grader's modules (`tests.*`), the labs' helper files
   (lab3_reference, lab5_ranks, ...) and any module loaded from their files under another
   name leave sys.modules for the rest of the process, so `sys.modules["layer6_serving"]`
   (also as `os.sys.modules`, `importlib.import_module`, `__import__` of an imported package)
   finds nothing. The grader keeps the module objects it already holds; when its own code
   imports one again, the finder below hands back that same object, and the next checkpoint
   (every test, every import the submission makes) takes it out again.
2. A `sys.meta_path` finder, first in line: importing one of those names by any route
   (`import`, `__import__`, `importlib.import_module`, `exec("import ...")`) while the
   submission's code is on the calling stack raises ImportError, saying why.
3. The submission's builtins are a copy whose `__import__` refuses those names outright. The
   copy also marks the submission's frames: code it compiles, execs or evals inherits it.
4. An audit hook refuses, to the submission's code, opening the files of the layer packages,
   of labs/ and of tests/ (no `exec(open(".../lab7_reference.py").read())`, no
   `spec_from_file_location`; what tracebacks left of them in linecache is dropped), and
   taking frames or heap objects directly (`sys._getframe`, `inspect.stack()`, a traceback's
   or generator's frame, `gc.get_objects`).

What the grader hands a submission holds no path back either: tests pass plain data, and a
callback passes through `detached`, which gives it a namespace of its own (a function's
`__globals__` would otherwise be the test module's, reference and all).

Out of scope, as for lab 1's kernel check: taking the grader apart on purpose (walking the
objects of sys.meta_path, closures, ctypes, another process). That is for a human to see.
Under plain pytest (grading the reference) nothing here is installed.
"""
from __future__ import annotations

import builtins
import importlib.abc
import importlib.util
import linecache
import os
import re
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

LABS_ROOT = Path(__file__).resolve().parents[2]
_LAYER = re.compile(r"layer\d+_[a-z]+")
_LAB_DIR = re.compile(r"lab\d+_[a-z]+")
#: Audit events that take frames or heap objects, refused when the submission's code asks.
_INTROSPECTION = frozenset({"sys._getframe", "sys._current_frames", "gc.get_objects",
                            "gc.get_referrers", "gc.get_referents"})
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_WATCHED = _INTROSPECTION | {"open", "object.__getattr__"}


class _State:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.builtins = dict(builtins.__dict__, __import__=_guarded_import)
        self.hidden: dict[str, ModuleType] = {}
        self.dirty = True
        self.helpers = {p.stem for p in (LABS_ROOT / "labs").glob("lab*_*/*.py")} - {"exercises"}


_state: _State | None = None
_real_import = builtins.__import__
_busy = threading.local()


def refusal(name: str) -> str:
    return (f"the grader refuses `{name}` in a submission: the layer packages and the grader's "
            "files hold the answers. Write your own (Python, torch and the standard library are "
            "fine)")


def protected_name(name: str) -> bool:
    """A module a submission may not reach: a layer package, the grader, a lab helper file."""
    top = name.partition(".")[0]
    return bool(_LAYER.fullmatch(top)) or top == "tests" or (
        _state is not None and top in _state.helpers)


def protected_file(path: str) -> bool:
    """A file a submission may not open: a layer package's, or one of a checkout's labs/ or
    tests/labs/ (the submission itself excepted)."""
    parts = Path(path).parts
    if _state is not None and path == _state.path:
        return False
    return any(_LAYER.fullmatch(p) for p in parts) or any(
        a == "labs" and (_LAB_DIR.fullmatch(b) or b == "README.md") or (a, b) == ("tests", "labs")
        for a, b in zip(parts, parts[1:], strict=False))


def _is_submission(frame: types.FrameType | None) -> bool:
    return frame is not None and _state is not None and (
        frame.f_builtins is _state.builtins or frame.f_code.co_filename == _state.path)


def submission_running(frame: types.FrameType | None = None) -> bool:
    """Is the submission's code anywhere on this thread's stack?"""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if _is_submission(frame):
            return True
        frame = frame.f_back
    return False


def _protected_module(name: str, module: object) -> bool:
    """Protected by its name, or by its file (a layer's or a lab's, loaded under any name)."""
    if protected_name(name):
        return True
    path = getattr(module, "__file__", None)
    return (isinstance(path, str) and ("layer" in path or "labs" in path)
            and protected_file(os.path.realpath(path)))


def hide() -> None:
    """Take every protected module out of sys.modules (the grader keeps its references)."""
    state = _state
    for name in [n for n, m in list(sys.modules.items()) if _protected_module(n, m)]:
        module = sys.modules.pop(name, None)
        if module is not None:
            state.hidden[name] = module
    for path in [p for p in linecache.cache if "layer" in p or "labs" in p]:
        if protected_file(os.path.realpath(path)):  # source a traceback left in memory
            linecache.cache.pop(path, None)
    state.dirty = False


def checkpoint() -> None:
    """Hide again what the grader's own imports have put back since the last time."""
    if _state is not None and _state.dirty:
        hide()


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and protected_name(name):
        raise ImportError(refusal(name), name=name)
    checkpoint()
    return _real_import(name, globals, locals, fromlist, level)


class _HandBack(importlib.abc.Loader):
    """Gives the grader back a module it imported before the submission was loaded."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import machinery set ours; the original stays


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _state is None or not protected_name(name):
            return None
        if submission_running(sys._getframe(1)):
            raise ImportError(refusal(name), name=name)
        _state.dirty = True  # the grader's import: it lands in sys.modules until the next hide
        module = _state.hidden.pop(name, None)
        if module is None:
            return None  # never imported yet: the usual finders load it
        return importlib.util.spec_from_loader(name, _HandBack(module),
                                               is_package=hasattr(module, "__path__"))


def _audit(event: str, args: tuple) -> None:
    if event not in _WATCHED or _state is None or getattr(_busy, "on", False):
        return
    _busy.on = True
    try:
        caller = sys._getframe(1)
        if event == "open":
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)) and submission_running(caller):
                if protected_file(os.path.realpath(os.fsdecode(path))):
                    raise PermissionError(f"the grader refuses opening {os.fsdecode(path)} "
                                          "in a submission: its files hold the answers")
            return
        if event == "object.__getattr__" and (len(args) < 2 or args[1] not in _FRAME_ATTRS):
            return
        # asked by the submission's code itself, or through inspect (currentframe, stack)
        direct = _is_submission(caller) or (
            caller.f_code.co_filename.endswith("inspect.py") and _is_submission(caller.f_back))
        if direct:
            raise RuntimeError(f"the grader refuses {event} {args[1] if len(args) > 1 else ''}"
                               "in a submission: grade on what your functions return")
    finally:
        _busy.on = False


def _install(path: Path) -> _State:
    global _state
    if _state is not None:
        if _state.path != str(path):
            raise RuntimeError(f"one submission per process: {_state.path} is loaded here")
        return _state
    _state = _State(path)
    sys.meta_path.insert(0, _Finder())
    sys.addaudithook(_audit)
    return _state


def load_submission(path: str | Path) -> ModuleType:
    """Import a student's file as a fresh module, behind the guard (see the module docstring).
    Raises what its import raised (ImportError naming a refused package among them)."""
    path = Path(path).resolve()
    state = _install(path)
    spec = importlib.util.spec_from_file_location(f"submission_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    module.__builtins__ = state.builtins  # what its code (and code it execs) imports through
    hide()
    sys.modules[spec.name] = module  # as an import does: dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    finally:
        hide()
    return module


def detached(fn: Callable) -> Callable:
    """fn with a namespace of its own (the builtins only), to hand to a submission: a
    function's __globals__ is its module's namespace, which here holds the reference."""
    out = types.FunctionType(fn.__code__, {"__builtins__": builtins}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out
