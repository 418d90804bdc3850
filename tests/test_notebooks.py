"""Notebook hygiene; every notebook runs end to end under papermill with the smoke profile, and
``kvshot figures`` redraws every figure from the tables kept beside it, byte for byte."""

import ast
import json

import pytest

from kvshot_lib import cli, plots, runner
from kvshot_lib.target import REPO_ROOT

NOTEBOOKS = runner.list_notebooks()
pytestmark = pytest.mark.timeout(1800)  # the smoke run of every notebook, on a busy 2-core machine
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


@pytest.fixture(scope="module")
def smoke_run():
    return runner.run_profile("smoke")


def test_smoke_profile_runs_every_notebook(smoke_run):
    assert [r["notebook"] for r in smoke_run] == [p.name for p in NOTEBOOKS.values()]
    figures = {p.name for p in (REPO_ROOT / "figures" / "smoke").glob("*.png")}
    for number in NOTEBOOKS:
        assert any(f.startswith(number) for f in figures), f"notebook {number} saved no figure"
    assert (REPO_ROOT / "runs" / "smoke" / "results" / "run_log.json").is_file()


def test_kvshot_figures_redraws_every_figure_byte_for_byte(smoke_run, tmp_path):
    figure_dir = REPO_ROOT / "figures" / "smoke"
    drawn = sorted(p.stem for p in figure_dir.glob("*.png"))
    assert drawn == sorted(plots.FIGURES), "every registered figure is drawn by the smoke run, and no other"
    assert cli.main(["figures", "--profile", "smoke", "--out", str(tmp_path)]) == 0
    for name in drawn:
        for ext in (".png", ".pdf"):
            original, redrawn = figure_dir / f"{name}{ext}", tmp_path / f"{name}{ext}"
            assert redrawn.read_bytes() == original.read_bytes(), f"{name}{ext} differs when redrawn"


def test_kvshot_figures_names_the_missing_table(smoke_run, tmp_path, capsys):
    figure_dir = tmp_path / "figures"
    (figure_dir / "data").mkdir(parents=True)
    (figure_dir / "02_per_step_accuracy.png").write_bytes(b"")  # the figure is there, its table is not
    with pytest.raises(
        plots.FigureDataError, match="02_per_step_accuracy.*per_step_accuracy.csv.*02_train_drafters"
    ):
        plots.redraw(figure_dir)
    (figure_dir / "data" / "per_step_accuracy.csv").write_text("drafter,accuracy\nx,0.5\n")
    with pytest.raises(plots.FigureDataError, match="lacks the columns"):
        plots.redraw(figure_dir)
