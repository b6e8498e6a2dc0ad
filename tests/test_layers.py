"""The import graph of sinklens: no circles, no import up the layers, no private name across packages.

The layers are the ``[tool.importlinter]`` contract in pyproject.toml. Every import counts: at
module level, inside functions and under ``TYPE_CHECKING`` (grimp, which import-linter uses, reads
them all from the source).
"""

from __future__ import annotations

import ast
import pkgutil
import re
import tomllib
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

import sinklens

PACKAGE = Path(sinklens.__file__).parent
ROOT = PACKAGE.parent


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("sinklens", cache_dir=None)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One shortest circle through each import that lies on one, as a list of modules."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                found.append([importer, *back])
    return found


def test_no_import_circles(graph):
    assert circles(graph) == []


def test_circles_are_found():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    assert circles(g) == []
    g.add_import(importer="p.c", imported="p.a")
    assert circles(g) == [["p.a", "p.b", "p.c", "p.a"], ["p.b", "p.c", "p.a", "p.b"], ["p.c", "p.a", "p.b", "p.c"]]


def test_layers_only_point_down(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    failed = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert failed == 0, capsys.readouterr().out


def test_every_top_level_module_has_a_layer():
    """A module the contract does not name would be free to import anything."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    named = {name for layer in contract["layers"] for name in re.split(r"\s*[|:]\s*", layer)}
    modules = {f"sinklens.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE)])}
    assert modules == named


def private_names_across_packages() -> list[str]:
    """``from sinklens.x import _name`` where the importer lives in another package than ``sinklens.x``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own_package = module.rpartition(".")[0] if path.name != "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sinklens") and node.level == 0:
                target = PACKAGE.parent.joinpath(*node.module.split("."))
                target_package = node.module if target.is_dir() else node.module.rpartition(".")[0]
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and target_package != own_package:
                        found.append(f"{module}: from {node.module} import {alias.name}")
    return found


def test_no_private_name_crosses_a_package():
    assert private_names_across_packages() == []
