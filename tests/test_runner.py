"""Profiles are validated against the notebooks' parameters cells before anything runs."""

import json

import nbformat
import pytest

from kvshot_lib import runner
from kvshot_lib.runner import NotebookFailed, Profile, ProfileError, plan_run

HEADER = 'profile = "x"\nrun_dir = "r"\nfigure_dir = "f"\n'


def _notebook(path, params_source, body="x = 1"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(HEADER + params_source)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# test"), cell, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def nbdir(tmp_path):
    _notebook(tmp_path / "00_a.ipynb", "n = 3\nrate = 0.5\nflag = False\nname = 'a'\n")
    _notebook(tmp_path / "01_b.ipynb", "n = 4\nlayers = [1, 2]\n")
    return tmp_path


def test_parameters_reach_only_the_notebooks_that_declare_them(nbdir):
    plan = plan_run(
        Profile("p", parameters={"n": 7, "rate": 1}, overrides={"01": {"layers": [3]}}), notebook_dir=nbdir
    )
    assert [(nb.name, params) for nb, params in plan] == [
        ("00_a.ipynb", {"n": 7, "rate": 1}),
        ("01_b.ipynb", {"n": 7, "layers": [3]}),
    ]
    plan = plan_run(Profile("p", parameters={"n": 7}), only=["1"], sets={"n": 9}, notebook_dir=nbdir)
    assert [(nb.name, params) for nb, params in plan] == [("01_b.ipynb", {"n": 9})]


@pytest.mark.parametrize(
    "profile, sets, match",
    [
        (Profile("p", parameters={"nope": 1}), None, "Unknown parameter 'nope'"),
        (Profile("p"), {"n": "three"}, r"00_a.ipynb: parameter 'n' expects int"),
        (Profile("p"), {"flag": 1}, r"00_a.ipynb: parameter 'flag' expects bool"),
        (Profile("p"), {"n": 2.5}, "expects int"),
        (Profile("p", overrides={"01": {"rate": 0.1}}), None, r"01_b.ipynb: the profile overrides 'rate'"),
        (Profile("p", parameters={"run_dir": "x"}), None, "set by the runner"),
        (Profile("p", notebooks=["07"]), None, "do not exist"),
    ],
)
def test_bad_parameters_name_the_notebook_and_key(nbdir, profile, sets, match):
    with pytest.raises(ProfileError, match=match):
        plan_run(profile, sets=sets, notebook_dir=nbdir)


def test_only_runs_with_the_whole_profile_but_sets_must_fit_the_selection(nbdir):
    profile = Profile("p", parameters={"rate": 0.2, "layers": [4]})
    plan = plan_run(profile, only=["01"], notebook_dir=nbdir)  # 'rate' is for 00 only: still valid
    assert [(nb.name, params) for nb, params in plan] == [("01_b.ipynb", {"layers": [4]})]
    with pytest.raises(ProfileError, match="Unknown parameter 'rate'"):
        plan_run(Profile("p"), only=["01"], sets={"rate": 0.3}, notebook_dir=nbdir)


def test_parameters_cell_must_hold_literals(tmp_path):
    _notebook(tmp_path / "00_a.ipynb", "n = len('abc')\n")
    with pytest.raises(ProfileError, match="not a literal"):
        plan_run(Profile("p"), notebook_dir=tmp_path)


def test_set_values_are_parsed_as_yaml():
    assert runner.parse_sets(["a=3", "b=0.5", "c=[1, 2]", "d=tiny-llama", "e=true"]) == {
        "a": 3,
        "b": 0.5,
        "c": [1, 2],
        "d": "tiny-llama",
        "e": True,
    }
    with pytest.raises(ProfileError, match="key=value"):
        runner.parse_sets(["oops"])


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ProfileError, match="Unknown profile 'nope'"):
        runner.load_profile("nope")


@pytest.mark.parametrize("name", runner.available_profiles())
def test_packaged_profiles_fit_the_real_notebooks(name):
    assert {"smoke", "default", "qwen3-8b"} <= set(runner.available_profiles())
    profile = runner.load_profile(name)
    plan = plan_run(profile)
    assert [nb.name[:2] for nb, _ in plan] == (profile.notebooks or sorted(runner.list_notebooks()))


def test_failing_notebook_stops_the_run_and_is_kept(tmp_path):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "00_ok.ipynb", "n = 1\n", "print('fine')")
    _notebook(nbdir / "01_bad.ipynb", "n = 1\n", "raise ValueError('deliberate failure')")
    _notebook(nbdir / "02_never.ipynb", "n = 1\n", "print('should not run')")
    profile = tmp_path / "mine.yaml"
    profile.write_text("parameters: {n: 2}\n")
    with pytest.raises(
        NotebookFailed, match=r"01_bad.ipynb failed in cell 3 .*ValueError: deliberate failure"
    ):
        runner.run_profile(str(profile), root=tmp_path, notebook_dir=nbdir)
    kept = tmp_path / "runs" / "mine" / "01_bad.ipynb"
    assert kept.is_file() and "deliberate failure" in kept.read_text()
    assert not (tmp_path / "runs" / "mine" / "02_never.ipynb").exists()
    ok = json.loads((tmp_path / "runs" / "mine" / "00_ok.ipynb").read_text())
    injected = [c for c in ok["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert "n = 2" in "".join(injected[0]["source"])


def test_the_progress_line_expects_this_machines_last_time_else_the_profiles(tmp_path):
    """The estimate: the notebook's seconds in this run's log (newest first), else the profile's minutes."""
    path = tmp_path / "p.yaml"
    path.write_text("expected_minutes: {2: 25, '03': 1.5}\n")
    profile = runner.load_profile(str(path))
    assert profile.expected_minutes == {"02": 25.0, "03": 1.5}
    history = [
        {"notebooks": [{"notebook": "02_train.ipynb", "seconds": 700.0}]},
        {"notebooks": [{"notebook": "02_train.ipynb", "seconds": 640.0}]},
    ]
    assert runner.expected_seconds("02_train.ipynb", history, profile) == 640.0
    assert runner.expected_seconds("03_x.ipynb", history, profile) == 90.0
    assert runner.expected_seconds("04_y.ipynb", history, profile) is None
    path.write_text("expected_minutes: [1, 2]\n")
    with pytest.raises(ProfileError, match="'expected_minutes' must be a mapping"):
        runner.load_profile(str(path))


def test_a_run_logs_each_notebook_as_it_finishes(tmp_path):
    """A run stopped by a failing notebook keeps the times of those before it (the next run's estimates)."""
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook(nbdir / "00_ok.ipynb", "n = 1\n", "print('fine')")
    _notebook(nbdir / "01_bad.ipynb", "n = 1\n", "raise ValueError('deliberate failure')")
    profile = tmp_path / "mine.yaml"
    profile.write_text("parameters: {n: 2}\nexpected_minutes: {'00': 1}\n")
    with pytest.raises(NotebookFailed):
        runner.run_profile(str(profile), root=tmp_path, notebook_dir=nbdir)
    log = json.loads((tmp_path / "runs" / "mine" / "results" / "run_log.json").read_text())
    assert [r["notebook"] for r in log[-1]["notebooks"]] == ["00_ok.ipynb"]
