"""Every notebook 00-07 through papermill on a lent GPU, under the ``gpu-smoke`` profile, in one command.

    make gpu-bundle                      here: tokenizer, data and the notebooks' wheels in gpu_bundle/ (git-ignored)
    make gpu-notebooks                   there, from the repository root, with gpu_bundle carried along
    make gpu-notebooks GPU_SCALE=tiny    here, the same path at toy shapes on a CPU (tests/test_gpu_notebooks.py)

On the GPU machine (its own python3, torch and transformers; no registry, no install of the suite) it:

1. installs the bundle's wheels that python lacks (papermill, the kernel, matplotlib, ...) into ``--site`` with
   ``pip --no-index --no-deps`` (``gpu_wheels.install_missing``), and puts that folder and the repository on the
   ``PYTHONPATH`` the notebooks' kernels inherit;
2. builds the target once: a Qwen3-8B-shaped model with random weights in bf16 on the GPU and SmolLM2's tokenizer
   from the bundle (``--scale tiny``: the tiny Qwen3 shape in float32 on the CPU), saved as a local folder that every
   notebook loads; ``--target /path/to/Qwen3-8B`` uses that folder instead and builds nothing;
3. runs notebooks 00-07 in order with ``kvshot_lib.runner.run_profile`` under ``gpu-smoke``, the target set to that
   folder, reading ShareGPT and MT-bench from the bundle (``KVSHOT_ASSETS_DIR``); a failed notebook is recorded and
   the next one still runs;
4. writes, after every notebook, one JSON summary (each notebook's status and seconds, every table it wrote with its
   rows and count of non-finite values, the figures it drew), a markdown table of the same name, and a few figures
   as PNG: at most 8 files, into ``$OUT`` where set (the lent machine's folder that comes back), else ``--out-dir``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import gpu_wheels

REPO = Path(__file__).resolve().parents[1]
PROFILE = "gpu-smoke"
NOTEBOOKS = ("00", "01", "02", "03", "04", "05", "06", "07")
FIGURES = (  # the PNGs that come back beside the summary: with the JSON, the markdown and a log, 8 files
    "02_per_step_accuracy", "03_acceptance_by_step", "04_query_error_by_step", "06_speedup_vs_mat", "07_specpv_speed",
)  # fmt: skip
MAX_ROWS = 20  # rows of one table kept in the summary (each numeric column's range covers them all)
# ShareGPT records the bundle must hold: the suite's splits hold out the first 500 of a seeded permutation of the
# records (corpus.DEFAULT_EVAL_SIZE), and notebook 00 takes 50 more for its length statistics (make gpu-bundle: 700)
BUNDLE_CONVERSATIONS = 700
# per scale: the target's shape and dtype, the device, and what the run sets beyond the profile
SCALES = {
    "qwen3-8b": dict(config="QWEN3_8B_CONFIG", device="cuda", dtype="bfloat16", sets={}),
    # toy shapes, the same code: the tiny Qwen3 shape (8 layers: the probes read the middle of its drafters' layers
    # 1, 3, 4), a 512-token draft vocabulary and 256-token sequences (a 32,000-token vocabulary over 2 x 512 tokens
    # and 7 unrolled steps takes minutes per drafter on a 2-core CPU), shorter SpecPV contexts and budgets
    "tiny": dict(
        config="TINY_CONFIG",
        device="cpu",
        dtype="float32",
        sets=dict(
            device="cpu",
            dtype="float32",
            probe_layers=[3],
            draft_vocab_size=512,
            max_len=256,
            max_tokens=256,
            contexts=[512, 1024],
            budgets=[128, 256],
            speed_budgets=[256],
            cost_lengths=[256, 512, 1024],
            precisions=["auto"],  # bf16 where this CPU has it natively; 06 refuses bf16 emulated in software
        ),
    ),
}


def run_name(scale: str) -> str:
    return PROFILE if scale == "qwen3-8b" else f"{PROFILE}-{scale}"


def check_bundle(bundle: Path) -> int:
    """The bundle's ShareGPT record count; refuses one too small for the notebooks' splits (an older bundle)."""
    manifest = bundle / "bundle.json"
    records = json.loads(manifest.read_text()).get("sharegpt_records", 0) if manifest.is_file() else 0
    if records < BUNDLE_CONVERSATIONS:
        raise SystemExit(
            f"gpu_notebooks: the bundle at {bundle} holds {records} ShareGPT records; the notebooks' splits need "
            f"{BUNDLE_CONVERSATIONS} (the first 500 are held out). Run `make gpu-bundle` again."
        )
    return records


def prepare_environment(bundle: Path | None, site: Path) -> list[str]:
    """Install what this python lacks from the bundle's wheels; the kernels papermill starts inherit the path."""
    if bundle is not None:
        check_bundle(bundle)
        os.environ["KVSHOT_ASSETS_DIR"] = str(Path(bundle).resolve() / "assets")
    installed = gpu_wheels.install_missing(bundle / "wheels" if bundle else None, site)
    importlib.invalidate_caches()
    paths = [str(site)] if site.is_dir() else []
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    needed = ("papermill", "ipykernel", "matplotlib", "seaborn", "scipy", "yaml")
    missing = [m for m in needed if not _importable(m)]
    if missing:
        raise SystemExit(
            f"gpu_notebooks: this python ({sys.executable}) lacks {missing} and the bundle has no wheel for them; "
            "run `make gpu-bundle` where pip reaches the registry and carry gpu_bundle along."
        )
    return installed


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def bundle_manifest(bundle: Path | None) -> dict:
    """What the bundle carried: its data files' bytes and its wheels' count and bytes (the manifests it holds)."""
    if bundle is None:
        return dict(folder=None, note="installed assets, no bundle")
    out: dict = dict(folder=bundle.name)
    for key, manifest in (("data", bundle / "bundle.json"), ("wheels", bundle / "wheels" / "wheels.json")):
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            out[key] = dict(bytes=m["bytes"], files=len(m.get("files") or m.get("wheels") or {}))
    return out


def build_target(scale: str, bundle: Path | None, folder: Path, seed: int = 0) -> dict:
    """The random target, built once on the scale's device and saved with its tokenizer as a local model folder."""
    import torch
    from transformers import AutoTokenizer

    from kvshot_lib.target import QWEN3_8B_CONFIG, TINY_CONFIG, random_target, smollm2_tokenizer

    s = SCALES[scale]
    config = {"QWEN3_8B_CONFIG": QWEN3_8B_CONFIG, "TINY_CONFIG": TINY_CONFIG}[s["config"]]
    config = {k: v for k, v in config.items() if k != "vocab_size"}  # the tokenizer gives the vocabulary
    tokenizer = AutoTokenizer.from_pretrained(str(bundle / "tokenizer")) if bundle else smollm2_tokenizer()
    t0 = time.perf_counter()
    target = random_target(config, "qwen3", tokenizer, s["device"], s["dtype"], seed, name=f"random-{scale}")
    if s["device"] == "cuda":
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    target.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = dict(
        source=f"random weights, seed {seed}, Qwen3 family, SmolLM2's tokenizer ({len(tokenizer):,} tokens)",
        folder=str(folder),
        n_params=target.info.n_params,
        dtype=target.info.dtype,
        build_seconds=round(built, 1),
        save_seconds=round(time.perf_counter() - t0 - built, 1),
    )
    del target
    gc.collect()  # the notebooks' kernels load the folder: this process keeps no copy on the GPU
    if s["device"] == "cuda":
        torch.cuda.empty_cache()
    return info


def table_rows(frame) -> tuple[list[dict], dict]:
    """A table's first rows as records (floats rounded, empty cells None) and, per numeric column that has any, how
    many cells are NaN (an empty cell: e.g. a spread over one seed) or infinite."""
    numeric = frame.select_dtypes("number").astype(float)
    nonfinite = {}
    for column in numeric.columns:
        nan, inf = int(numeric[column].isna().sum()), int(numeric[column].map(math.isinf).sum())
        if nan or inf:
            nonfinite[column] = dict(nan=nan, inf=inf)
    head = frame.head(MAX_ROWS).astype(object).where(frame.head(MAX_ROWS).notna(), None)
    rows = [
        {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
        for r in head.to_dict("records")
    ]
    return rows, nonfinite


def column_ranges(frame) -> dict:
    """``{column: [min, max]}`` over the finite values of each numeric column (None: no finite value)."""
    numeric = frame.select_dtypes("number").astype(float)
    out = {}
    for column in numeric.columns:
        finite = numeric[column][numeric[column].map(math.isfinite)]
        out[column] = [round(float(finite.min()), 6), round(float(finite.max()), 6)] if len(finite) else None
    return out


def read_tables(folders: list[Path], since: float) -> dict:
    """Every CSV in ``folders`` written since ``since`` (a notebook's start, wall clock), by its path under the
    repository: rows, columns, its empty and infinite cells and numeric ranges per column, its first rows."""
    import pandas as pd

    tables, first = {}, {}  # first: the table already read with the same bytes (a notebook saves some twice)
    for folder in folders:
        for path in sorted(folder.glob("*.csv")):
            if path.stat().st_mtime < since:
                continue
            name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest in first:
                tables[name] = dict(same_as=first[digest])
                continue
            first[digest] = name
            try:
                frame = pd.read_csv(path)
            except (ValueError, pd.errors.EmptyDataError) as e:
                tables[name] = dict(error=f"{type(e).__name__}: {e}")
                continue
            rows, nonfinite = table_rows(frame)
            tables[name] = dict(
                n_rows=len(frame), columns=list(frame.columns), nonfinite=nonfinite, ranges=column_ranges(frame),
                rows=rows,
            )  # fmt: skip
    return tables


def machine() -> dict:
    """The GPU check's record of the machine (``gpu_stages.recording``) with the versions the notebooks ran on."""
    from gpu_stages.recording import machine as where
    from gpu_stages.recording import preflight

    return {**where(), **preflight()}


def markdown(summary: dict) -> str:
    lines = [
        f"# notebooks 00-07 under `{summary['profile']}` ({summary['scale']}) on {summary['machine']['gpu'] or 'CPU'}",
        "",
        f"{summary['done']} done in {summary['total_seconds']} s; target: {summary['target'].get('source')}"
        + "".join(f"; {k}={v}" for k, v in (summary.get("sets") or {}).items())
        + ".",
        "",
        "| notebook | status | seconds | tables | NaN cells | infinite cells | figures |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for nb in summary["notebooks"]:
        cells = [c for t in nb.get("tables", []) for c in summary["tables"][t].get("nonfinite", {}).values()]
        lines.append(
            f"| {nb['notebook']} | {nb['status']} | {nb.get('seconds', '')} | {len(nb.get('tables', []))} | "
            f"{sum(c['nan'] for c in cells)} | {sum(c['inf'] for c in cells)} | {len(nb.get('figures', []))} |"
        )
    errors = [f"- {nb['notebook']}: {nb['error']}" for nb in summary["notebooks"] if nb.get("error")]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def write_summary(summary: dict, out_dir: Path, figure_dir: Path) -> Path:
    """The JSON, its markdown and the chosen figures of ``figure_dir``: 7 files in ``out_dir`` at most."""
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if summary["scale"] == "qwen3-8b" else f"_{summary['scale']}"
    dest = out_dir / f"gpu_notebooks_{summary['machine']['name']}{suffix}.json"
    dest.write_text(json.dumps(summary, indent=1))
    dest.with_suffix(".md").write_text(markdown(summary))
    for name in FIGURES:
        if (figure_dir / f"{name}.png").is_file():
            shutil.copy2(figure_dir / f"{name}.png", out_dir / f"{name}.png")
    return dest


def run(
    scale: str, bundle: Path | None, target: str | None, out_dir: Path, site: Path, only=None, extra=None
) -> dict:
    """Prepare, build, run the notebooks, summarize (the module doc); ``extra``: parameters set beyond the scale's."""
    t_start = time.perf_counter()
    installed = prepare_environment(bundle, site)
    from kvshot_lib import runner

    name = run_name(scale)
    summary = dict(
        check="gpu_notebooks", profile=PROFILE, scale=scale, run=name, machine=machine(), wheels_installed=installed,
        bundle=bundle_manifest(bundle), sets=extra or {}, target={}, notebooks=[], tables={}, done="",
        total_seconds=0.0,
    )  # fmt: skip
    if target is None:
        from kvshot_lib.target import cache_dir

        folder = cache_dir() / "models" / f"random-{scale}"
        summary["target"] = build_target(scale, bundle, folder)
        target = str(folder)
    else:
        summary["target"] = dict(source=f"the folder {target}", folder=target)
    sets = {**SCALES[scale]["sets"], **(extra or {}), "target": str(Path(target).resolve())}
    run_dir, figure_dir = REPO / "runs" / name, REPO / "figures" / name
    if not only:  # a whole run starts clean; --only reruns notebooks on the outputs of the ones before them
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(figure_dir, ignore_errors=True)
    selected = [n for n in NOTEBOOKS if not only or n in only]
    for number in selected:
        t0, started = time.perf_counter(), time.time()
        row = dict(notebook=number, status="running")
        summary["notebooks"].append(row)
        try:
            declared = runner.notebook_parameters(runner.list_notebooks()[number])
            mine = {k: v for k, v in sets.items() if k in declared}  # what this notebook declares
            [record] = runner.run_profile(PROFILE, only=[number], sets=mine, root=REPO, run_name=name)
            row.update(status="ok", file=record["notebook"])
        except Exception as e:  # the next notebook still runs; the error is in the summary
            traceback.print_exc()
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:4000])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        tables = read_tables([figure_dir / "data", run_dir / "results"], started)
        summary["tables"].update(tables)
        row["tables"] = sorted(tables)
        row["figures"] = sorted(p.name for p in figure_dir.glob("*.png") if p.stat().st_mtime >= started)
        ok = sum(r["status"] == "ok" for r in summary["notebooks"])
        summary.update(done=f"{ok} of {len(selected)}", total_seconds=round(time.perf_counter() - t_start, 1))
        dest = write_summary(summary, out_dir, figure_dir)
        print(
            f"[gpu-notebooks] {row['notebook']}: {row['status']} in {row['seconds']} s -> {dest}", flush=True
        )
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="qwen3-8b")
    ap.add_argument(
        "--bundle", type=Path, default=None, help="the folder make gpu-bundle wrote (default: installed)"
    )
    ap.add_argument(
        "--target", default=None, help="a local model folder (e.g. Qwen3-8B) instead of the random build"
    )
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="default: $OUT where set, else runs/<run>/summary/"
    )
    ap.add_argument(
        "--site", type=Path, default=Path("/tmp/kvshot-site"), help="where missing wheels install"
    )
    ap.add_argument("--only", default=None, help="comma-separated notebook numbers (default: all)")
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a parameter"
    )
    args = ap.parse_args(argv)
    out = args.out_dir or (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / run_name(args.scale) / "summary"
    )
    only = [s.zfill(2) for s in args.only.split(",")] if args.only else None
    bundle = args.bundle.resolve() if args.bundle else None
    from kvshot_lib.runner import (
        parse_sets,
    )  # torch, transformers and PyYAML: on the GPU machine before any install

    extra = parse_sets(args.sets)
    summary = run(args.scale, bundle, args.target, out, args.site, only, extra)
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(nb["status"] == "ok" for nb in result["notebooks"]) else 1)
