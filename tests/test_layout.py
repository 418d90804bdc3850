"""The house rules of the library: imports run down the flow, and its users import public names only."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import kvshot_lib
from kvshot_lib.target import REPO_ROOT

LIB = REPO_ROOT / "kvshot_lib"
# The flow, one rank per stage: a package may import only packages of a lower rank (siblings do not meet).
RANK = {
    "target": 0,
    "corpus": 1,
    "drafters": 2,
    "training": 3,
    "decoding": 3,
    "evaluation": 4,
    "diagnostics": 5,
    "plots": 5,
    "runner": 6,
    "reference": 7,
    "cli": 8,
}
LAZY = {"reference"}  # imports nothing in its __init__ (the device's stage command must not load torch)


def _kvshot_imports(tree: ast.AST, package: str | None = None) -> list[tuple[str, list[str]]]:
    """(module path below kvshot_lib, imported names) for every import of kvshot_lib in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level and package:  # relative: ``..x`` from inside kvshot_lib/<package>/
                if node.level == 1:
                    continue  # its own package
                base = node.module or ""
                found.append((base, [a.name for a in node.names]))
            elif node.module and (node.module == "kvshot_lib" or node.module.startswith("kvshot_lib.")):
                found.append(
                    (node.module.removeprefix("kvshot_lib").lstrip("."), [a.name for a in node.names])
                )
        elif isinstance(node, ast.Import):
            found += [
                (a.name.removeprefix("kvshot_lib").lstrip("."), [])
                for a in node.names
                if a.name.startswith("kvshot_lib")
            ]
    return found


def _stage(module: str, names: list[str]) -> list[str]:
    """The top-level parts of kvshot_lib an import reaches (``from kvshot_lib import a, b`` reaches a and b)."""
    return [module.split(".")[0]] if module else names


@pytest.mark.parametrize("package", sorted(RANK))
def test_imports_run_down_the_flow(package):
    path = LIB / package
    files = sorted(path.glob("*.py")) if path.is_dir() else [LIB / f"{package}.py"]
    assert files, f"no module for {package}"
    for f in files:
        tree = ast.parse(f.read_text())
        for module, names in _kvshot_imports(tree, package if path.is_dir() else None):
            for stage in _stage(module, names):
                if stage == package or stage not in RANK:
                    continue
                assert RANK[stage] < RANK[package], (
                    f"{f.relative_to(REPO_ROOT)} imports {stage}, later in the flow"
                )


def _user_files():
    for pattern in ("tests/*.py", "benchmarks/*.py", "scripts/**/*.py"):
        for f in sorted(REPO_ROOT.glob(pattern)):
            yield f, f.read_text()
    for nb in sorted(REPO_ROOT.glob("notebooks/*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        yield nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    readme = (REPO_ROOT / "README.md").read_text()
    yield REPO_ROOT / "README.md", "\n".join(re.findall(r"```python\n(.*?)```", readme, re.S))


def _public(module) -> set[str]:
    """A package's ``__all__`` and its submodules; a plain module's names without a leading underscore."""
    if not hasattr(module, "__path__"):
        return {n for n in dir(module) if not n.startswith("_")}
    return set(getattr(module, "__all__", ())) | {
        p.stem for p in Path(module.__file__).parent.iterdir() if not p.name.startswith("_")
    }


def test_users_import_public_names_only():
    wrong = []
    for f, source in _user_files():
        for module, names in _kvshot_imports(ast.parse(source)):
            parts = module.split(".") if module else []
            if parts and parts[0] in LAZY:
                continue
            if len(parts) > 1:
                wrong.append(f"{f.relative_to(REPO_ROOT)}: kvshot_lib.{module}")
                continue
            package = importlib.import_module(f"kvshot_lib.{parts[0]}") if parts else kvshot_lib
            public = _public(package)
            wrong += [
                f"{f.relative_to(REPO_ROOT)}: {n} from kvshot_lib.{module}" for n in names if n not in public
            ]
    assert not wrong, "import these from their package's public names:\n" + "\n".join(wrong)


def test_the_rule_catches_a_private_import():
    tree = ast.parse("from kvshot_lib.training.loop import new_drafter\nfrom kvshot_lib import training\n")
    assert _kvshot_imports(tree) == [("training.loop", ["new_drafter"]), ("", ["training"])]
    tree = ast.parse("from ..decoding import generate\nfrom .config import X\n")
    assert _kvshot_imports(tree, "training") == [("decoding", ["generate"])]
