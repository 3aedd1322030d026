"""The package's shape: modules import only downward through the declared layers (imports inside functions
count; imports under ``if TYPE_CHECKING:`` do not), no import cycle, no private name imported across modules,
and no function over 100 lines or class over 400 lines (docstrings excluded). See docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "nantrace"

# module (dotted, relative to the package) -> layer; lower layers never import higher ones.
LAYERS: dict[str, int] = {
    # 0 leaves: errors, schema, masks, naming, tree flattening, files, the number formatter, the version
    **dict.fromkeys(
        [
            *("_errors", "_schema", "_fmt", "_masks", "_tree", "_naming", "_files", "_version"),
            *("examples", "examples.chargpt", "examples.hunting", "integrations"),
        ],
        0,
    ),
    # 1 recording: statistics, store, hooks, capture, process group, options, file format, session
    **dict.fromkeys(
        [
            "_stats",
            "_store",
            "_drill",
            "_hooks",
            "_capture",
            "_procgroup",
            "_options",
            "_format",
            "_scaler",
            "_samples",
            "_opfacts",
            "_recording",
            "_watch",
        ],
        1,
    ),
    # 2 the plain run view
    "_view": 2,
    # 3 analysis over the view, and file formats beside it
    **dict.fromkeys(
        [
            "_locate",
            "_repro",
            "_overflow",
            "_ranges",
            "_evidence",
            "_explain",
            "_diagnosis",
            "_facts",
            "_causes",
            "_scale_causes",
            "_diagnose",
            "_readiness",
            "_compare",
            "_watched",
            "_live",
            "_io",
            "_hunt",
        ],
        3,
    ),
    # 4 presentation
    **dict.fromkeys(["_report", "plot", "_tensorboard"], 4),
    # 5 the facade
    "_trace": 5,
    # 6 front-ends (none imports another), 7 the ones built on a shared front-end piece, 8 the CLI, 9 the package
    **dict.fromkeys(["_run", "integrations._common"], 6),
    **dict.fromkeys(["integrations.lightning", "integrations.transformers"], 7),
    "cli": 8,
    **dict.fromkeys(["__main__", ""], 9),
}
FRONT_ENDS = {"_run", "integrations._common", "integrations.lightning", "integrations.transformers"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every nantrace import of module ``name``."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.split(".")[0] == "nantrace":
                target = node.module.removeprefix("nantrace").removeprefix(".")
            else:
                return
            names = [a.name for a in node.names]
            mods = [f"{target}.{n}".lstrip(".") for n in names if f"{target}.{n}".lstrip(".") in known]
            for m in mods:  # ``from . import _causes``: the submodule itself
                found.append((m, [], node.lineno))
            rest = [n for n in names if f"{target}.{n}".lstrip(".") not in known]
            if rest or not mods:
                found.append((target, rest, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "nantrace":
                    found.append((a.name.removeprefix("nantrace").removeprefix("."), [], node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_declared_layer() -> None:
    assert sorted(set(_modules()) - set(LAYERS)) == []
    assert sorted(set(LAYERS) - set(_modules())) == []


def test_imports_go_down_the_layers_only() -> None:
    bad = []
    for mod, imports in _graph().items():
        for target, _, line in imports:
            if target == mod:
                continue
            up = LAYERS[target] > LAYERS[mod]
            sideways = mod in FRONT_ENDS and target in FRONT_ENDS and LAYERS[target] == LAYERS[mod]
            if up or sideways:
                bad.append(f"{mod}:{line} imports {target} (layer {LAYERS[mod]} -> {LAYERS[target]})")
    assert bad == []


def test_there_is_no_import_cycle() -> None:
    graph = {m: sorted({t for t, _, _ in imps if t != m}) for m, imps in _graph().items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def dfs(m: str, path: list[str]) -> bool:
        state[m] = 1
        for t in graph.get(m, []):
            if state.get(t) == 1:
                cycle.extend([*path[path.index(t) :], t] if t in path else [m, t])
                return True
            if state.get(t) is None and dfs(t, [*path, t]):
                return True
        state[m] = 2
        return False

    for m in graph:
        if state.get(m) is None and dfs(m, [m]):
            break
    assert cycle == []


def test_no_private_name_crosses_modules() -> None:
    bad = [
        f"{mod}:{line} imports {n} from {target}"
        for mod, imports in _graph().items()
        for target, names, line in imports
        for n in names
        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]
    assert bad == []


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    n = (node.end_lineno or node.lineno) - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        n -= (first.end_lineno or first.lineno) - first.lineno + 1
    return n


@pytest.mark.parametrize(("kind", "limit"), [(ast.FunctionDef, 100), (ast.ClassDef, 400)])
def test_no_function_over_100_lines_and_no_class_over_400(kind: type, limit: int) -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind) or (kind is ast.FunctionDef and isinstance(node, ast.AsyncFunctionDef)):
                n = _body_lines(node)  # type: ignore[arg-type]
                if n > limit:
                    long.append(f"{name}.{node.name}: {n} lines")  # type: ignore[attr-defined]
    assert long == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The import reader sees imports inside functions, skips TYPE_CHECKING, and resolves relative imports."""
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ._schema import PHASES\n"
        "if TYPE_CHECKING:\n    from ._trace import Trace\n"
        "def g():\n    from ._locate import first_in_step\n    from . import _causes\n"
    )
    got = _imports("_x", f, {"_schema", "_trace", "_locate", "_causes"})
    assert [(t, n) for t, n, _ in got] == [
        ("_schema", ["PHASES"]),
        ("_locate", ["first_in_step"]),
        ("_causes", []),
    ]
