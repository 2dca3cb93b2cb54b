"""Signposts that cannot drift: every folder's ``__init__`` docstring names each of its
modules and subfolders, and ``kvstore/errors.py`` draws every exception class of the
package, under the class it derives from."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from support import REPO

ROOTS = ("kvstore", "tiers", "predictor", "client")
PACKAGES = sorted(init.parent for root in ROOTS for init in (REPO / root).rglob("__init__.py"))
ERRORS = REPO / "kvstore" / "errors.py"


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def names(module: str, text: str) -> bool:
    """Whether ``text`` names ``module``: as ``module.py``, ``module.<name>`` or a dotted
    path ending in it (``kvstore.cli.admin``)."""
    name = re.escape(module)
    own = re.search(rf"(?<![\w.]){name}\.(py\b|[A-Za-z_])", text)
    dotted = re.search(rf"\w\.{name}(?![\w.])", text)
    return own is not None or dotted is not None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_folder_docstring_names_each_of_its_modules(package: Path) -> None:
    """A module is named as ``name.py`` (or ``name.Thing``, or a dotted path ending in
    it), a subfolder as ``name/``."""
    text = docstring(package / "__init__.py")
    modules = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    folders = [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    missing = [f"{name}.py" for name in modules if not names(name, text)]
    missing += [f"{name}/" for name in folders if not re.search(rf"(?<![\w.]){name}/", text)]
    assert not missing, f"{package.relative_to(REPO)}/__init__.py does not name {missing}"


def drawn_tree() -> dict[str, str]:
    """The tree ``kvstore/errors.py`` draws: each class, and the class it hangs under."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in docstring(ERRORS).splitlines():
        if line.strip() == "KVStoreError":
            stack = [(-1, "KVStoreError")]
            continue
        match = re.search(r"\+-- (\w+)", line)
        if match is None or not stack:
            continue
        depth = match.start()
        while stack[-1][0] >= depth:
            stack.pop()
        parents[match.group(1)] = stack[-1][1]
        stack.append((depth, match.group(1)))
    return parents


def defined_tree() -> dict[str, str]:
    """Every class of the package deriving from ``KVStoreError``, and its base."""
    bases: dict[str, str] = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.bases:
                    base = node.bases[0]
                    if isinstance(base, ast.Name):
                        bases[node.name] = base.id
    derived: dict[str, str] = {}
    known = {"KVStoreError"}
    while True:
        found = {n: b for n, b in bases.items() if b in known and n not in derived}
        if not found:
            return derived
        derived.update(found)
        known |= found.keys()


def test_errors_py_draws_every_exception_under_its_base() -> None:
    assert drawn_tree() == defined_tree()
