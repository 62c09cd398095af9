"""The relay between layers: one hop at a time.

Each layer's ``__init__`` imports the layer beneath as a namespace (layer 2's ``kernels`` is
layer 1, layer 4's ``executor`` is layer 3, ...) and re-exports by name what the layer above
needs. import-linter sees imports, not attribute chains, so a module could still write
``parallel.engine.executor.encode_prompt`` in layer 6 and depend on layer 3 unseen. This test
reads every module of the packages (AST, no imports) and fails on any attribute chain that
goes through two relay namespaces; a second test plants such chains to prove it can fail.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = sorted(p.name for p in ROOT.glob("layer[0-7]_*") if p.is_dir())


def layer_index(package: str) -> int | None:
    head = package.split(".")[0]
    return int(head[5]) if head in LAYERS else None


def relay_names(root: Path) -> dict[int, str]:
    """Layer K -> the name under which its __init__ exposes layer K-1 (e.g. 4 -> "executor")."""
    names = {}
    for package in LAYERS:
        k = int(package[5])
        tree = ast.parse((root / package / "__init__.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if layer_index(alias.name) == k - 1 and alias.asname:
                        names[k] = alias.asname
    return names


def namespaces(root: Path) -> dict[int, dict[str, int]]:
    """Layer K -> {name: layer} for every name its __init__ binds to a layer below: the relay
    (layer 4's ``executor`` is layer 3) and any namespace passed up by name (layer 4's ``comm``)."""
    exported: dict[int, dict[str, int]] = {}
    for package in LAYERS:  # bottom up: an __init__ may pass on what the one beneath exports
        k = int(package[5])
        finder = _ChainFinder(k, exported, package + "/__init__.py")
        finder.visit(ast.parse((root / package / "__init__.py").read_text()))
        exported[k] = {name: layer for name, (layer, _) in finder.scopes[0].items() if layer != k}
    return exported


@dataclass(frozen=True)
class Chain:
    path: str
    line: int
    text: str


class _ChainFinder(ast.NodeVisitor):
    """Binds names to layers as imports and simple assignments do, then walks attribute chains.

    A binding is (layer, hops): the layer the name stands for and how many layer namespaces were
    crossed to reach it. ``import layer5_parallel as parallel`` binds (5, 0); in layer 6,
    ``parallel.engine`` is (4, 1) and ``parallel.engine.executor`` (3, 2): a violation.
    """

    def __init__(self, own_layer: int, exported: dict[int, dict[str, int]], path: str):
        self.own, self.exported, self.path = own_layer, exported, path
        self.scopes: list[dict[str, tuple[int, int]]] = [{}]
        self.found: list[Chain] = []
        self._reported: set[int] = set()

    # -- bindings ------------------------------------------------------------------------
    def _bind(self, name: str, value: tuple[int, int] | None) -> None:
        if value is not None:
            self.scopes[-1][name] = value
        else:
            self.scopes[-1].pop(name, None)

    def _lookup(self, name: str) -> tuple[int, int] | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _step(self, value: tuple[int, int], attr: str) -> tuple[int, int] | None:
        layer, hops = value
        below = self.exported.get(layer, {}).get(attr)
        return None if below is None else (below, hops + 1)

    def _descend(self, value: tuple[int, int] | None, attrs: list[str]) -> tuple[int, int] | None:
        for attr in attrs:
            if value is None:
                return None
            value = self._step(value, attr)
        return value

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            k = layer_index(alias.name)
            if k is None:
                continue
            if alias.asname:
                self._bind(alias.asname, (k, 0) if "." not in alias.name else None)
            else:
                self._bind(alias.name.split(".")[0], (k, 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = LAYERS[self.own] if node.level else node.module
        k = layer_index(module or "")
        if k is None or (node.level and node.module):  # a submodule of this layer
            return
        for alias in node.names:
            bound = self._step((k, 0), alias.name)
            if bound is not None:  # a layer namespace, imported by name
                self._bind(alias.asname or alias.name, bound)

    def _resolve(self, node: ast.AST) -> tuple[int, int] | None:
        """The layer an expression stands for, if it is a name or a chain through namespaces."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        return self._descend(self._lookup(node.id), list(reversed(attrs)))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        pairs = [(t, node.value) for t in node.targets]
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                and len(node.targets) == 1 and len(value.elts) == len(target.elts):
            pairs = list(zip(target.elts, value.elts, strict=True))
        for target, value in pairs:
            if isinstance(target, ast.Name):
                self._bind(target.id, self._resolve(value))

    # -- scopes --------------------------------------------------------------------------
    def _scoped(self, node: ast.AST) -> None:
        self.scopes.append({})
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _scoped

    # -- chains --------------------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        """Report the longest chain that has crossed two namespaces (for a name inside the
        last namespace, ``a.b.c.name``, the chain ``a.b.c`` is what is reported)."""
        value = self._resolve(node)
        if value is not None and value[1] >= 2:
            if node.lineno not in self._reported:
                self._reported.add(node.lineno)
                self.found.append(Chain(self.path, node.lineno, ast.unparse(node)))
            return
        self.generic_visit(node)


def find_chains(root: Path) -> list[Chain]:
    exported = namespaces(root)
    found: list[Chain] = []
    for package in LAYERS:
        own = int(package[5])
        for path in sorted((root / package).rglob("*.py")):
            finder = _ChainFinder(own, exported, str(path.relative_to(root)))
            finder.visit(ast.parse(path.read_text(), filename=str(path)))
            found.extend(finder.found)
    return found


def test_every_layer_relays_the_one_beneath():
    assert relay_names(ROOT) == {1: "hardware", 2: "kernels", 3: "comm", 4: "executor",
                                 5: "engine", 6: "parallel"}


def test_no_chain_reaches_two_layers_down():
    chains = find_chains(ROOT)
    assert not chains, "attribute chains through two relay namespaces:\n" + "\n".join(
        f"  {c.path}:{c.line}: {c.text}" for c in chains)


@pytest.mark.parametrize(
    ("module", "source", "chain"),
    [
        ("layer6_serving/_deep.py",
         "import layer5_parallel as l5\nx = l5.engine.executor.encode_prompt\n",
         "l5.engine.executor"),
        ("layer3_model/_deep.py", "from layer2_comm import kernels\nf = kernels.hardware.time_fn\n",
         "kernels.hardware"),
        ("layer7_app/_deep.py", "import layer6_serving as l6\n\ndef f():\n    p = l6.parallel\n"
         "    return p.engine.LLM\n", "p.engine"),
        ("layer4_algorithms/_deep.py",
         "from . import executor\nk = executor.comm.kernels.paged_decode\n",
         "executor.comm.kernels"),
    ],
)
def test_chain_check_can_fail(tmp_path: Path, module: str, source: str, chain: str):
    for name in LAYERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text((ROOT / name / "__init__.py").read_text())
    (tmp_path / module).write_text(source)
    found = find_chains(tmp_path)
    assert [c.text for c in found] == [chain], found
    assert found[0].path == module


def test_one_hop_is_fine(tmp_path: Path):
    for name in LAYERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text((ROOT / name / "__init__.py").read_text())
    (tmp_path / "layer3_model" / "_ok.py").write_text(
        "from layer2_comm import kernels\ny = kernels.rms_norm\n")
    (tmp_path / "layer6_serving" / "_ok.py").write_text(
        "import layer5_parallel as parallel\nLLM = parallel.LLM\nself_engine = object()\n")
    assert find_chains(tmp_path) == []
