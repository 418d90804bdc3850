"""Notebook hygiene, and every notebook runs end to end under papermill with the smoke profile."""

import ast
import json

import pytest

from kvshot_lib import runner
from kvshot_lib.assets import REPO_ROOT

NOTEBOOKS = runner.list_notebooks()
REQUIRED = {"profile", "run_dir", "figure_dir", "target", "device", "dtype", "seed"}


def test_there_are_notebooks():
    assert "00" in NOTEBOOKS


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_notebook_is_stripped_parameterized_and_short(number):
    path = NOTEBOOKS[number]
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert nb["cells"][0]["cell_type"] == "markdown", "first cell states the question"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"{path.name}: strip outputs"
            )
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    assert node.end_lineno - node.lineno < 6, (
                        f"{path.name}: {node.name} belongs in kvshot_lib"
                    )
    params = runner.notebook_parameters(path)  # exactly one tagged cell, literals only
    assert REQUIRED <= set(params), f"{path.name} must declare {sorted(REQUIRED - set(params))}"


def test_smoke_profile_runs_every_notebook():
    records = runner.run_profile("smoke")
    assert [r["notebook"] for r in records] == [p.name for p in NOTEBOOKS.values()]
    figures = {p.name for p in (REPO_ROOT / "figures" / "smoke").glob("*.png")}
    for number in NOTEBOOKS:
        assert any(f.startswith(number) for f in figures), f"notebook {number} saved no figure"
    assert (REPO_ROOT / "runs" / "smoke" / "results" / "run_log.json").is_file()
