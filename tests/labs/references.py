"""Where a lab's reference (what plain `pytest` grades) comes from: a layer package, or, for
a lab whose exercises are teaching-size twins of the layer's components, the lab's answer
key `labs/labN_<name>/labN_reference.py` (it says what it simplifies and where the real
component is). Test files name it in REFERENCE; `import_reference` loads either."""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

LABS = Path(__file__).resolve().parents[2] / "labs"
_ANSWER_KEY = re.compile(r"lab(\d+)_reference")
_loaded: dict[str, ModuleType] = {}


def import_reference(name: str) -> ModuleType:
    """The module REFERENCE names: `labN_reference` is the lab's answer-key file, loaded
    once by path (the grader keeps it, whatever a submission's guard takes out of
    sys.modules later); any other name is imported as usual."""
    match = _ANSWER_KEY.fullmatch(name)
    if match is None:
        return importlib.import_module(name)
    if name not in _loaded:
        path = next(LABS.glob(f"lab{match.group(1)}_*/{name}.py"))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
        _loaded[name] = module
    return _loaded[name]
