"""The package's imports form no cycle, between modules or between folders, and run
one way between the layers.

The folders are the package's audiences (``kvstore/__init__`` draws them)::

    format (kvstore/*.py) <- tiers <- store <- wire <- server, client, predictor <- cli
    format <- local (what kvstore starts for itself) <- predictor

the daemon being the one place that wires the predictor to a store, and the
client knowing neither.

Every import statement counts, wherever it stands (module level, inside a
function, under ``TYPE_CHECKING``): a lazy import is still a dependency. The
front door (``kvstore/__init__.py``, ``kvstore/__main__.py``) is the one
exception: it names every public object, lazily, and nothing inside the
package imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import REPO

ROOT = REPO
# Source folder -> the package it installs as (pyproject's package-dir).
SOURCES = {
    "kvstore": "kvstore",
    "tiers": "kvstore.tiers",
    "predictor": "kvstore.predictor",
    "client": "kvstore.client",
}
FRONT_DOOR = frozenset({"kvstore", "kvstore.__main__"})


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    @property
    def folder(self) -> str:
        """The folder as a package name: ``kvstore.store``, ``kvstore.tiers``, ``kvstore``."""
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for source, package in SOURCES.items():
        for path in sorted((ROOT / source).rglob("*.py")):
            parts = path.relative_to(ROOT / source).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            found[name] = Module(name, path)
    return found


def imported(module: Module, known: dict[str, Module]) -> Iterator[str]:
    """The project modules ``module`` imports, by name."""
    is_package = module.path.name == "__init__.py"
    for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.name.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module.name:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(module, known)) for name, module in known.items()}


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a path that starts and ends on the same node, if any."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_front_door_is_imported_by_nothing_inside() -> None:
    importers = sorted(name for name, targets in graph().items() if FRONT_DOOR & targets)
    assert importers == []


def test_no_module_imports_itself_round_a_cycle() -> None:
    edges = {name: targets - FRONT_DOOR for name, targets in graph().items()}
    assert cycle_in(edges) is None


def test_no_folder_imports_itself_round_a_cycle() -> None:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        if name in FRONT_DOOR:
            continue
        folder = known[name].folder
        edges.setdefault(folder, set()).update(
            known[target].folder for target in targets if known[target].folder != folder
        )
    assert cycle_in(edges) is None


# What each layer never imports (its sub-folders included).
NEVER: dict[str, tuple[str, ...]] = {
    "kvstore": ("kvstore.tiers", "kvstore.local", "kvstore.store", "kvstore.wire",
                "kvstore.server", "kvstore.client", "kvstore.predictor", "kvstore.cli"),
    "kvstore.tiers": ("kvstore.local", "kvstore.store", "kvstore.wire", "kvstore.server",
                      "kvstore.client", "kvstore.predictor", "kvstore.cli"),
    "kvstore.local": ("kvstore.store", "kvstore.wire", "kvstore.server", "kvstore.client",
                      "kvstore.predictor", "kvstore.cli"),
    "kvstore.store": ("kvstore.local", "kvstore.wire", "kvstore.server", "kvstore.client",
                      "kvstore.predictor", "kvstore.cli"),
    "kvstore.wire": ("kvstore.local", "kvstore.server", "kvstore.client", "kvstore.predictor",
                     "kvstore.cli"),
    "kvstore.predictor": ("kvstore.server", "kvstore.client", "kvstore.cli"),
    "kvstore.client": ("kvstore.local", "kvstore.server", "kvstore.predictor", "kvstore.cli"),
    "kvstore.server": ("kvstore.local", "kvstore.client", "kvstore.cli"),
}


def _within(folder: str, layer: str) -> bool:
    """Whether ``folder`` is ``layer`` (for the format, the top folder only) or below it."""
    if layer == "kvstore":
        return folder == "kvstore"
    return folder == layer or folder.startswith(layer + ".")


@pytest.mark.parametrize("layer", sorted(NEVER))
def test_dependencies_run_one_way(layer: str) -> None:
    known = modules()
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        if name not in FRONT_DOOR and _within(known[name].folder, layer)
        for target in targets
        if any(_within(known[target].folder, above) for above in NEVER[layer])
    )
    assert wrong == []


def test_every_folder_sits_in_a_named_layer() -> None:
    """Every folder is one the layers above name (or below one of them), so a new
    folder is placed on purpose."""
    layers = {"kvstore.tiers", "kvstore.local", "kvstore.store", "kvstore.wire",
              "kvstore.server", "kvstore.client", "kvstore.predictor", "kvstore.cli"}
    folders = {module.folder for module in modules().values()} - {"kvstore"}
    unplaced = sorted(
        folder
        for folder in folders
        if not any(folder == layer or folder.startswith(layer + ".") for layer in layers)
    )
    assert unplaced == []


def test_the_front_door_lists_every_public_name_it_resolves() -> None:
    import kvstore

    assert sorted(kvstore.__all__) == sorted(kvstore._PUBLIC)
    for name in kvstore.__all__:
        assert getattr(kvstore, name).__name__ == name


STORE_PRIVATE = frozenset({"kvstore.store.core", "kvstore.store.state"})


def test_a_stores_state_is_touched_only_inside_the_store() -> None:
    """Its core and its state (lock, index, placement, counters) are the store's own
    modules' business: a daemon, a client or the predictor asks a face."""
    known = modules()
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        if not _within(known[name].folder, "kvstore.store")
        for target in targets & STORE_PRIVATE
    )
    assert wrong == []


def test_the_daemon_imports_no_tier() -> None:
    """It reaches blocks through the store (``kvstore.store.shared``), never a tier, and
    names kinds by the format's ``kvstore.kinds``."""
    known = modules()
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        if _within(known[name].folder, "kvstore.server")
        for target in targets
        if _within(known[target].folder, "kvstore.tiers")
    )
    assert wrong == []
