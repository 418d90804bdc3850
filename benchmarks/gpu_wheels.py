"""The wheels the notebooks import that a bare GPU machine lacks, carried in the GPU bundle (``gpu_bundle/wheels``).

A lent GPU machine has its own python 3.12 with torch, transformers, accelerate, pandas, safetensors, numpy and tqdm,
and no package registry. Notebooks under papermill also need papermill, a kernel (ipykernel, jupyter_client, pyzmq,
...), matplotlib, seaborn and ipywidgets. Here, where pip reaches the registry:

    python benchmarks/gpu_wheels.py gpu_bundle/wheels      (make gpu-bundle runs it)

downloads, for CPython 3.12 on linux x86_64, the same version of every package in the dependency closure of
:data:`ROOTS` that is installed here, less the closure of :data:`ON_GPU_MACHINE` and less :data:`LEFT_OUT`. There,
:func:`install_missing` installs with ``pip --no-index --no-deps --target`` only the wheels whose distribution that
python does not already have, so nothing the machine has is shadowed (``benchmarks/gpu_notebooks.py`` calls it).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = (
    "papermill",
    "nbclient",
    "nbformat",
    "ipykernel",
    "jupyter-client",
    "ipywidgets",
    "matplotlib",
    "seaborn",
)
ON_GPU_MACHINE = ("torch", "transformers", "accelerate", "pandas", "safetensors", "numpy", "tqdm")
LEFT_OUT = {
    "scipy": "35 MB; in the GPU machine's image (/work/.library/device/KINDS.md lists it); the preflight checks it",
    "aiohttp": "papermill reads it only for http:// notebooks; in the GPU machine's image",
    "debugpy": "5 MB; ipykernel imports it under try (no debugger, kernels run)",
    "jedi": "5 MB; IPython imports it only to complete code interactively",
    "parso": "jedi's own need",
}
PYTHON = "3.12"  # the GPU machine's python3 (KINDS.md: Python 3.12.3)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
PLATFORMS += ("manylinux1_x86_64", "any")
MARKERS = dict(
    python_version=PYTHON, python_full_version=f"{PYTHON}.3", sys_platform="linux", platform_system="Linux",
    platform_machine="x86_64", os_name="posix", implementation_name="cpython",
    platform_python_implementation="CPython", extra="",
)  # fmt: skip


def requirements(name: str) -> list[str]:
    """The installed distribution ``name``'s requirements that apply on the GPU machine (no extras)."""
    reqs = [Requirement(r) for r in md.distribution(name).requires or []]
    return [canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def closure(roots) -> set[str]:
    """Every distribution ``roots`` need, by their installed metadata; one not installed here is kept by name."""
    seen: set[str] = set()
    stack = [canonicalize_name(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            stack += requirements(name)
        except md.PackageNotFoundError:
            pass
    return seen


def wheel_specs() -> list[str]:
    """``name==version`` of each wheel to carry: the installed version of every distribution the roots need."""
    names = closure(ROOTS) - closure(ON_GPU_MACHINE) - set(LEFT_OUT)
    return sorted(f"{n}=={md.version(n)}" for n in names)


def download(out: Path) -> dict:
    """Download the wheels for CPython :data:`PYTHON` on linux x86_64 into ``out`` (emptied first); the manifest
    ``wheels.json`` lists each file and size and what was left out and why."""
    out = Path(out)
    for old in out.glob("*.whl"):
        old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    tags = [f"--platform={p}" for p in PLATFORMS] + [
        f"--abi={a}" for a in (f"cp{PYTHON.replace('.', '')}", "abi3")
    ]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--implementation=cp",
    ]
    cmd += [f"--python-version={PYTHON}", "--abi=none", *tags, "-d", str(out), *wheel_specs()]
    subprocess.run(cmd, check=True)
    files = {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}
    manifest = dict(python=PYTHON, wheels=files, bytes=sum(files.values()), left_out=LEFT_OUT)
    (out / "wheels.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def distribution_of(wheel: Path) -> str:
    """A wheel file's distribution name, canonical (``jupyter_client-8.10.0-py3-none-any.whl`` -> jupyter-client)."""
    return canonicalize_name(re.split(r"-\d", Path(wheel).name, maxsplit=1)[0])


def missing_wheels(wheel_dir: Path) -> list[Path]:
    """The wheels in ``wheel_dir`` whose distribution this python does not have installed."""
    have = {canonicalize_name(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
    return [w for w in sorted(Path(wheel_dir).glob("*.whl")) if distribution_of(w) not in have]


def install_missing(wheel_dir: Path | None, site: Path) -> list[str]:
    """Install the missing wheels of ``wheel_dir`` into ``site`` with no registry and no dependency resolution, and
    put ``site`` on this process's path; returns their file names (none where the folder is absent)."""
    wheels = missing_wheels(wheel_dir) if wheel_dir is not None and Path(wheel_dir).is_dir() else []
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        subprocess.run(cmd, check=True)
    if Path(site).is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return [w.name for w in wheels]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the folder to fill with wheels (gpu_bundle/wheels)")
    args = ap.parse_args(argv)
    manifest = download(args.out)
    print(
        f"wrote {args.out}: {len(manifest['wheels'])} wheels, {manifest['bytes'] / 1e6:.1f} MB (CPython {PYTHON})"
    )
    return manifest


if __name__ == "__main__":
    main()
