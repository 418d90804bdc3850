"""``make gpu-notebooks``: every notebook under the gpu-smoke profile, the way a lent GPU machine runs it.

The fast tests check the profile against qwen3-8b's settings, the wheels the bundle carries, their install (only what
this python lacks, with no registry) and the summary's counts. The slow one runs ``make gpu-notebooks GPU_SCALE=tiny``
for real: the same script, bundle and profile at toy shapes on the CPU, with a fresh cache as on a bare machine."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import zipfile

import pandas as pd
import pytest
import yaml

from kvshot_lib import runner
from kvshot_lib.target import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"
MAY_BE_EMPTY = (
    "speedup_divergences.csv",
)  # float32 outputs that differ from plain decoding's: none, we hope


def _script(name: str):
    """A script of benchmarks/ as a module, registered by name: they import each other so when run."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_wheels = _script("gpu_wheels")
gpu_notebooks = _script("gpu_notebooks")


def _profile(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "kvshot_lib" / "profiles" / f"{name}.yaml").read_text())


def test_gpu_smoke_keeps_the_qwen3_8b_settings_that_shape_the_gpu_path():
    smoke, paper = _profile("gpu-smoke"), _profile("qwen3-8b")
    for key in ("device", "dtype", "data_source", "ttt_steps", "draft_vocab_size", "batch_size", "lr",
                "branch_fraction", "query_group", "eval_branch_fraction"):  # fmt: skip
        assert smoke["parameters"][key] == paper["parameters"][key], key
    assert (smoke["parameters"]["device"], smoke["parameters"]["dtype"]) == ("cuda", "bfloat16")
    for nb, keys in {"03": ("chain_depth", "tree_depth", "tree_top_k", "tree_budget"),
                     "04": ("n_steps", "chain_depth"),
                     "06": ("chain_depth", "tree_depth", "tree_top_k", "tree_budget", "precisions")
                     }.items():  # fmt: skip
        for key in keys:
            assert smoke["overrides"][nb][key] == paper["overrides"][nb][key], (nb, key)
    assert smoke["overrides"]["01"]["probe_layers"] == paper["overrides"]["01"]["probe_layers"]


def test_gpu_smoke_plans_every_notebook_with_a_folder_as_its_target(tmp_path):
    plan = runner.plan_run(runner.load_profile("gpu-smoke"), sets={"target": str(tmp_path)})
    assert [nb.name[:2] for nb, _ in plan] == list(gpu_notebooks.NOTEBOOKS)
    assert all(params["target"] == str(tmp_path) and params["device"] == "cuda" for _, params in plan)
    trained = {
        d.get("name") or f"{d['paradigm']}-{d['regime']}"
        for d in _profile("gpu-smoke")["overrides"]["02"]["drafters"]
    }
    assert (
        set(_profile("gpu-smoke")["overrides"]["06"]["drafter_methods"]) <= trained
    )  # only drafters 02 trains


def test_the_bundle_carries_the_notebooks_stack_and_not_the_gpu_machines():
    names = {s.split("==")[0] for s in gpu_wheels.wheel_specs()}
    assert {"papermill", "nbclient", "nbformat", "ipykernel", "jupyter-client", "pyzmq", "tornado", "traitlets",
            "ipython", "ipywidgets", "matplotlib", "seaborn", "pillow", "kiwisolver"} <= names  # fmt: skip
    assert not names & {"torch", "transformers", "numpy", "pandas", "safetensors", "accelerate", "tqdm"}
    assert not names & set(gpu_wheels.LEFT_OUT)
    assert all("==" in s for s in gpu_wheels.wheel_specs())  # each at the version installed here


@pytest.mark.parametrize(
    "wheel, name",
    [
        ("jupyter_client-8.10.0-py3-none-any.whl", "jupyter-client"),
        ("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", "pyzmq"),
        ("ipython_pygments_lexers-1.1.1-py3-none-any.whl", "ipython-pygments-lexers"),
        ("PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.whl", "pyyaml"),
    ],
)
def test_a_wheels_distribution_is_read_from_its_file_name(wheel, name):
    assert gpu_wheels.distribution_of(wheel) == name


def _wheel(folder, dist: str, module: str) -> None:
    """A minimal pure-python wheel holding ``module`` with ``VALUE = 7``."""
    info = f"{dist}-0.1.dist-info"
    files = {
        f"{module}/__init__.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-0.1-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_install_missing_installs_only_what_this_python_lacks_without_a_registry(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "kvshot_gpu_probe", "kvshot_gpu_probe")  # not installed here
    _wheel(
        wheels, "PyYAML", "yaml_shadow"
    )  # installed here (the runner needs it): must not be installed again
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")  # a registry would fail: --no-index never asks
    assert [w.name for w in gpu_wheels.missing_wheels(wheels)] == ["kvshot_gpu_probe-0.1-py3-none-any.whl"]
    assert gpu_wheels.install_missing(wheels, site) == ["kvshot_gpu_probe-0.1-py3-none-any.whl"]
    assert (site / "kvshot_gpu_probe" / "__init__.py").is_file() and not (site / "yaml_shadow").exists()
    assert sys.path[0] == str(site)
    probe = importlib.import_module("kvshot_gpu_probe")
    assert probe.VALUE == 7
    sys.modules.pop("kvshot_gpu_probe", None)
    assert gpu_wheels.install_missing(None, tmp_path / "none") == []  # no wheels folder: nothing to do


def test_the_summary_counts_empty_and_infinite_cells_per_column():
    frame = pd.DataFrame(
        {"a": [1.0, math.nan, math.inf, -math.inf], "b": [1, 2, 3, 4], "c": ["x", None, "y", "z"]}
    )
    rows, nonfinite = gpu_notebooks.table_rows(frame)
    assert nonfinite == {"a": {"nan": 1, "inf": 2}}
    assert rows[1] == {"a": None, "b": 2, "c": None}


def test_the_summary_and_its_figures_fit_what_comes_back(tmp_path):
    figures = tmp_path / "figures"
    figures.mkdir()
    for name in [*gpu_notebooks.FIGURES, "00_other", "01_more", "05_more"]:
        (figures / f"{name}.png").write_bytes(b"png")
    summary = dict(scale="qwen3-8b", profile="gpu-smoke", machine=dict(name="nvidia-h200", gpu="NVIDIA H200"),
                   target=dict(source="random"), notebooks=[], tables={}, done="0 of 8", total_seconds=1.0)  # fmt: skip
    dest = gpu_notebooks.write_summary(summary, tmp_path / "out", figures)
    assert dest.name == "gpu_notebooks_nvidia-h200.json"
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 7  # the call's log is the eighth
    assert {f"{n}.png" for n in gpu_notebooks.FIGURES} <= set(files)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_make_gpu_notebooks_tiny_runs_every_notebook_from_a_bundle(tmp_path, monkeypatch):
    """The GPU command at toy shapes: bundle (without wheels: this python has them all), one target build, 8
    notebooks under papermill, the summary. A fresh cache, as on a bare machine: no SmolLM2, no earlier prompts."""
    monkeypatch.syspath_prepend(str(BENCH))  # the GPU check's parts, as its script imports them
    gpu_stages = importlib.import_module("gpu_stages")
    bundle = tmp_path / "gpu_bundle"
    gpu_stages.write_bundle(bundle, gpu_notebooks.BUNDLE_CONVERSATIONS)  # as make gpu-bundle writes it
    env = dict(
        os.environ, KVSHOT_CACHE=str(tmp_path / "cache"), OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1"
    )
    cmd = [
        "make",
        "-s",
        "gpu-notebooks",
        "GPU_SCALE=tiny",
        f"GPU_BUNDLE={bundle}",
        f"PYTHON={sys.executable}",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    out = tmp_path / "out"
    [summary_file] = out.glob("gpu_notebooks_*_tiny.json")
    summary = json.loads(summary_file.read_text())
    failed = {nb["notebook"]: nb.get("error") for nb in summary["notebooks"] if nb["status"] != "ok"}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    assert summary["done"] == "8 of 8" and [nb["notebook"] for nb in summary["notebooks"]] == list(
        gpu_notebooks.NOTEBOOKS
    )
    config = json.loads((tmp_path / "cache" / "models" / "random-tiny" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("qwen3", 8, 49152)
    for nb in summary["notebooks"]:
        assert nb["tables"] and nb["figures"], f"notebook {nb['notebook']} wrote no table or drew no figure"
    for name, table in summary["tables"].items():
        if "same_as" in table:
            assert table["same_as"] in summary["tables"]
            continue
        empty_ok = name.endswith(MAY_BE_EMPTY)  # a list of what went wrong: empty is the good outcome
        assert "error" not in table and (table["n_rows"] > 0 or empty_ok), (name, table.get("error"))
        assert not any(c["inf"] for c in table["nonfinite"].values()), (name, table["nonfinite"])
    assert len(list(out.iterdir())) <= 7


def test_make_gpu_bundle_carries_enough_records_for_the_notebooks_splits(tmp_path):
    from kvshot_lib.corpus import split_indices

    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"--write-bundle $(GPU_BUNDLE) --conversations {gpu_notebooks.BUNDLE_CONVERSATIONS}" in makefile
    stats = _profile("gpu-smoke")["overrides"]["00"]["n_stats_conversations"]
    train = split_indices(
        gpu_notebooks.BUNDLE_CONVERSATIONS, "train", seed=0
    )  # what the held-out split leaves
    assert len(train) >= 2 * stats  # notebook 00's sample, with slack for conversations it skips
    assert (
        len(split_indices(400, "train", seed=0)) == 0
    )  # gpu_check's own default bundle: an empty train split
    (tmp_path / "bundle.json").write_text(json.dumps({"sharegpt_records": 400}))  # gpu_check's own default
    with pytest.raises(SystemExit, match="holds 400 ShareGPT records"):
        gpu_notebooks.check_bundle(tmp_path)


def test_each_numeric_columns_range_is_over_its_finite_values():
    frame = pd.DataFrame(
        {"a": [2.0, math.nan, -1.5, math.inf], "b": [math.nan, math.nan, math.nan, math.nan]}
    )
    assert gpu_notebooks.column_ranges(frame) == {"a": [-1.5, 2.0], "b": None}


def test_a_short_online_run_finishes_into_a_folder_that_does_not_exist_yet(tmp_path):
    """Notebook 05 under gpu-smoke: 4 online steps, no state saved, no decay branch, so nothing has created the
    run's folder when its log tables are written (they are written before the checkpoint)."""
    from kvshot_lib.corpus import tokenize_sharegpt
    from kvshot_lib.target import load_target
    from kvshot_lib.training import TrainConfig, build_draft_vocab, train_drafter

    target = load_target("tiny-qwen3", device="cpu", seed=0)
    train = tokenize_sharegpt(target.tokenizer, "train", 3, 64, seed=0, use_cache=False)
    held = tokenize_sharegpt(target.tokenizer, "eval", 2, 64, seed=0, use_cache=False)
    cfg = TrainConfig(paradigm="kv", regime="ttt", ttt_steps=2, train_steps=2, batch_size=2, max_tokens=64,
                      draft_vocab_size=128, eval_every=2, eval_sequences=2, probe_every=0, save_every=0,
                      data_source="online")  # fmt: skip
    out = tmp_path / "remedies" / "baseline-seed0"
    run = train_drafter(
        target, train, held, cfg, out, d2t=build_draft_vocab(train, target, 128), progress=False
    )
    assert (out / "history.csv").is_file() and (out / "config.json").is_file()
    assert len(run.logs["history"]) == 2


def test_a_table_saved_twice_is_read_once_and_an_older_one_not_at_all(tmp_path):
    data, results = tmp_path / "data", tmp_path / "results"
    data.mkdir(), results.mkdir()
    (results / "old.csv").write_text("a\n1\n")
    os.utime(results / "old.csv", (1.0e9, 1.0e9))  # written before the notebook started
    for folder in (data, results):
        (folder / "speedup.csv").write_text("method,ratio\nchain,1.25\ntree,0.5\n")
    tables = gpu_notebooks.read_tables([data, results], since=time.time() - 60)
    assert sorted(tables) == [str(data / "speedup.csv"), str(results / "speedup.csv")]
    assert tables[str(results / "speedup.csv")] == {"same_as": str(data / "speedup.csv")}
    first = tables[str(data / "speedup.csv")]
    assert (first["n_rows"], first["ranges"], first["nonfinite"]) == (2, {"ratio": [0.5, 1.25]}, {})
