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
    "user_errors": -1,  # the errors a user can fix and the command's exit codes: any stage raises them
    "target": 0,
    "corpus": 1,
    "drafters": 2,
    "training": 3,
    "decoding": 3,
    "evaluation": 4,
    "diagnostics": 5,
    "plots": 5,
    "run_time": 4,  # how long each notebook of a profile takes (rates, work): needs asks it
    "needs": 5,  # what a profile needs (memory, disk, time): the runner asks it before a run
    "runner": 6,
    "reference": 7,
    "doctor": 7,
    "cli": 8,
}


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
    for pattern in ("tests/*.py", "benchmarks/**/*.py", "scripts/**/*.py"):
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


def _library_modules() -> dict[str, Path]:
    """Every module of kvshot_lib by dotted name below it (``decoding.engine``, ``decoding`` for its __init__)."""
    found = {}
    for f in sorted(LIB.rglob("*.py")):
        parts = list(f.relative_to(LIB).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = f
    return found


def _imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """``(imported module, name, line)`` for every import of kvshot_lib in ``module``, wherever it sits in the file
    (inside functions too); a name that is itself a module of kvshot_lib is resolved to that module."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if module else []
    package = here if is_package else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == "kvshot_lib" or node.module.startswith("kvshot_lib.")):
                target = node.module.removeprefix("kvshot_lib").lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                found.append((sub, "", node.lineno) if sub in modules else (target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [
                (a.name.removeprefix("kvshot_lib").lstrip("."), "", node.lineno)
                for a in node.names
                if a.name == "kvshot_lib" or a.name.startswith("kvshot_lib.")
            ]
    return found


def private_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of a ``_private`` name (or module) of another module, anywhere in the library."""
    wrong = []
    for module, path in modules.items():
        for target, name, line in _imports_of(module, path, modules):
            leaf = name or target.rsplit(".", 1)[-1]
            if leaf.startswith("_") and not leaf.startswith("__") and target != module:
                wrong.append(f"{path.parent.name}/{path.name}:{line} imports {name or target} from {target}")
    return wrong


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """Circles of imports between the modules of one package (a package's ``__init__`` counts as a module),
    imports made inside functions included."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for target, _name, _line in _imports_of(module, path, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target != module and (target == package or target.rpartition(".")[0] == package):
                graph[module].add(target)  # the package's __init__ or one of its modules
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (Tarjan), each sorted; singletons left out."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while not group or group[-1] != m:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(groups)


def test_no_module_imports_a_private_name_of_another():
    wrong = private_imports(_library_modules())
    assert not wrong, "make these public in one module, or move them where both can use them:\n" + "\n".join(
        wrong
    )


def test_no_import_circle_inside_a_package():
    circles = import_circles(_library_modules())
    assert not circles, "import circles (imports inside functions count):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_layout_rules_catch_todays_knots(tmp_path):
    """Each rule fails on a small library that has the knot it forbids (a circle made through an import inside a
    function, a private name imported from a sibling, a drafter importing decoding)."""
    pkg = tmp_path / "decoding"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .engine import generate\n")
    (pkg / "engine.py").write_text("def generate():\n    from .specpv import specpv_generate\n")
    (pkg / "specpv.py").write_text("from .engine import _commit, generate\n")
    modules = {
        "decoding": pkg / "__init__.py",
        "decoding.engine": pkg / "engine.py",
        "decoding.specpv": pkg / "specpv.py",
    }
    assert import_circles(modules) == [["decoding.engine", "decoding.specpv"]]
    assert [w.split(" imports ")[1] for w in private_imports(modules)] == ["_commit from decoding.engine"]
    tree = ast.parse("def f():\n    from ..decoding import generate\n")
    assert [s for m, names in _kvshot_imports(tree, "drafters") for s in _stage(m, names)] == ["decoding"]


def _target_calls(tree: ast.AST) -> list[int]:
    """Lines that call a model directly: ``model(...)``, ``x.model(...)`` (``target.model``, ``self.model``,
    ``model.model``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "model") or (
                isinstance(f, ast.Attribute) and f.attr == "model"
            ):
                lines.append(node.lineno)
    return lines


def test_every_target_forward_goes_through_the_seam():
    """target/forward.py is the one place that calls the target; no module passes ``past_key_values=``."""
    seam = LIB / "target" / "forward.py"
    for f in sorted(LIB.rglob("*.py")):
        text = f.read_text()
        assert "past_key_values=" not in text or f == seam, (
            f"{f.relative_to(REPO_ROOT)} passes past_key_values="
        )
        if f != seam:
            calls = _target_calls(ast.parse(text))
            assert not calls, f"{f.relative_to(REPO_ROOT)} calls the target directly at lines {calls}"


def test_the_seam_check_sees_a_direct_call():
    assert _target_calls(ast.parse("out = target.model(input_ids=x)\ny = model(x)\nz = f(x)")) == [1, 2]
