"""Profiles and papermill execution: ``kvshot run --profile NAME|PATH.yaml [--only 00,02] [--set key=value ...]``.

A profile is a YAML file::

    description: what this profile is for
    notebooks: ["00", "02"]        # optional: which numbered notebooks run, in order (default: all)
    parameters: {target: tiny-llama, seed: 0}      # for every notebook that declares the key
    overrides: {"02": {train_steps: 10}}           # for one notebook, keyed by its number

Every parameter is checked against the literal defaults of each notebook's ``parameters`` cell before
anything runs: a key that no selected notebook declares, or a value whose type differs from the
declared default's, is an error naming the notebook and the key. ``--dry-run`` prints what the run needs
(memory, disk, time per notebook: :mod:`kvshot_lib.needs`) and runs nothing; a real run refuses in one line where
this machine is short of memory or disk (``--force`` runs anyway). Executed notebooks go to
``runs/<profile>/``, result tables to ``runs/<profile>/results/`` and figures to ``figures/<profile>/``;
the runner passes those folders to each notebook as ``run_dir`` and ``figure_dir``.
"""

from __future__ import annotations

import ast
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import needs
from .target.assets import REPO_ROOT
from .user_errors import EXIT_FAILURE, EXIT_MACHINE_SHORT, EXIT_USAGE

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
INJECTED = ("profile", "run_dir", "figure_dir")  # every notebook declares these; the runner sets them


class ProfileError(ValueError):
    """A profile, a --set value or a notebook's parameters cell is wrong; the message says where."""


@dataclass
class Profile:
    name: str
    description: str = ""
    notebooks: list[str] | None = None
    parameters: dict = field(default_factory=dict)
    overrides: dict[str, dict] = field(default_factory=dict)
    expected_minutes: dict[str, float] = field(default_factory=dict)  # per notebook, measured on a 2-core CPU


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A packaged profile by name (``smoke``, ``default``, ``qwen3-8b``) or a YAML file by path."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ProfileError(
                f"Unknown profile {name_or_path!r}: not a YAML file and not one of {available_profiles()}."
            )
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {
        "description",
        "notebooks",
        "parameters",
        "overrides",
        "expected_minutes",
        "reference",
    }
    if unknown:
        raise ProfileError(
            f"{path}: unknown top-level keys {sorted(unknown)}; allowed: description, notebooks, "
            "parameters, overrides, expected_minutes (per notebook, for the progress line), reference (the "
            "reference run's rows and jobs, read by kvshot_lib.reference, not by the notebooks)."
        )
    for key in ("parameters", "overrides", "expected_minutes"):
        if not isinstance(raw.get(key) or {}, dict):
            raise ProfileError(f"{path}: '{key}' must be a mapping.")
    overrides = {str(k).zfill(2): v or {} for k, v in (raw.get("overrides") or {}).items()}
    notebooks = [str(n).zfill(2) for n in raw["notebooks"]] if raw.get("notebooks") else None
    expected = {str(k).zfill(2): float(v) for k, v in (raw.get("expected_minutes") or {}).items()}
    return Profile(
        path.stem, raw.get("description", ""), notebooks, raw.get("parameters") or {}, overrides, expected
    )


def list_notebooks(notebook_dir: Path = NOTEBOOK_DIR) -> dict[str, Path]:
    """Numbered notebooks by their two-digit prefix: {"00": Path(".../00_target_and_data.ipynb"), ...}."""
    return {p.name[:2]: p for p in sorted(notebook_dir.glob("[0-9][0-9]_*.ipynb"))}


def notebook_parameters(path: Path) -> dict:
    """The defaults declared in a notebook's cell tagged ``parameters`` (literal assignments only)."""
    cells = json.loads(Path(path).read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ProfileError(
            f"{Path(path).name}: expected exactly one cell tagged 'parameters', found {len(tagged)}."
        )
    source = "".join(tagged[0]["source"])
    params = {}
    for node in ast.parse(source).body:
        if not (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            raise ProfileError(
                f"{Path(path).name}: the parameters cell may only hold `name = literal` lines; "
                f"found: {ast.unparse(node)!r}"
            )
        try:
            params[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            raise ProfileError(
                f"{Path(path).name}: parameter {node.targets[0].id!r} is not a literal: "
                f"{ast.unparse(node.value)!r}"
            ) from None
    return params


def _type_ok(default, value) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def parse_sets(sets: list[str] | None) -> dict:
    """``["key=value", ...]`` → dict, values parsed as YAML scalars/lists (``5`` → int, ``[1,2]`` → list)."""
    out = {}
    for item in sets or []:
        if "=" not in item:
            raise ProfileError(f"--set expects key=value, got {item!r}.")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def plan_run(
    profile: Profile,
    only: list[str] | None = None,
    sets: dict | None = None,
    notebook_dir: Path = NOTEBOOK_DIR,
) -> list[tuple[Path, dict]]:
    """Check every parameter against the notebooks' declarations; return [(notebook, parameters)] in order."""
    available = list_notebooks(notebook_dir)
    in_profile = profile.notebooks or sorted(available)
    missing = [n for n in in_profile if n not in available]
    if missing:
        raise ProfileError(
            f"profile {profile.name!r} lists notebooks {missing} that do not exist; "
            f"available: {sorted(available)}."
        )
    selected = in_profile
    if only:
        only = [str(o).zfill(2) for o in only]
        missing = [o for o in only if o not in available]
        if missing:
            raise ProfileError(
                f"--only names notebooks {missing} that do not exist; available: {sorted(available)}."
            )
        selected = [n for n in sorted(available) if n in only]
    declared = {n: notebook_parameters(available[n]) for n in sorted(set(in_profile) | set(selected))}
    # The profile is checked as a whole, so that `--only` runs with the same profile as a full run;
    # a --set must be meant for one of the notebooks that will run.
    for keys, scope in ((profile.parameters, in_profile), (sets or {}, selected)):
        for key in keys:
            if key in INJECTED:
                raise ProfileError(f"{key!r} is set by the runner; remove it from the profile / --set.")
            if not any(key in declared[n] for n in scope):
                raise ProfileError(
                    f"Unknown parameter {key!r}: no notebook of this run ({', '.join(scope)}) declares it "
                    "in its parameters cell."
                )
    for n, extra in profile.overrides.items():
        if n not in declared:
            raise ProfileError(
                f"profile {profile.name!r} overrides notebook {n}, which is not in the profile."
            )
        for key in extra:
            if key not in declared[n]:
                raise ProfileError(
                    f"{available[n].name}: the profile overrides {key!r}, which this notebook's "
                    f"parameters cell does not declare (it declares {sorted(declared[n])})."
                )
    plan = []
    for n in selected:
        extra = profile.overrides.get(n, {})
        params = {
            k: v for k, v in {**profile.parameters, **extra, **(sets or {})}.items() if k in declared[n]
        }
        for key, value in params.items():
            if not _type_ok(declared[n][key], value):
                raise ProfileError(
                    f"{available[n].name}: parameter {key!r} expects "
                    f"{type(declared[n][key]).__name__} (default {declared[n][key]!r}), "
                    f"got {type(value).__name__} {value!r}."
                )
        lacking = [k for k in INJECTED if k not in declared[n]]
        if lacking:
            raise ProfileError(f"{available[n].name}: the parameters cell must declare {lacking}.")
        plan.append((available[n], params))
    return plan


def check_needs(
    name_or_path: str,
    only: list[str] | None = None,
    sets: dict | None = None,
    notebook_dir: Path = NOTEBOOK_DIR,
) -> tuple[str, str | None]:
    """What a run of the profile needs, as a table, and the one line saying what this machine lacks (None: it fits).
    The parameters are validated first, as for a run."""
    profile = load_profile(name_or_path)
    selected = [nb.name[:2] for nb, _ in plan_run(profile, only, sets, notebook_dir)]
    defaults = {n: notebook_parameters(path) for n, path in list_notebooks(notebook_dir).items()}
    full = {
        nb.name[:2]: {**defaults[nb.name[:2]], **p} for nb, p in plan_run(profile, None, sets, notebook_dir)
    }
    try:
        planned, context = needs.plan_needs(full, selected)
    except ValueError as e:
        return f"no estimate: {e}", None
    hand = needs.at_hand(context["device"])
    short = needs.shortfall(planned, hand)
    report = needs.needs_table(planned, context, hand)
    if short:
        return report, f"profile {profile.name!r} needs more than this machine has: {short}"
    return report + "\nfits: the memory and disk at hand cover this estimate.", None


def expected_seconds(notebook: str, history: list[dict], profile: Profile) -> float | None:
    """How long ``notebook`` should take: its last time in this run's log (this machine), else the profile's
    ``expected_minutes`` (measured on a 2-core CPU), else None."""
    for entry in reversed(history):
        for rec in entry.get("notebooks", []):
            if rec["notebook"] == notebook:
                return rec["seconds"]
    minutes = profile.expected_minutes.get(notebook[:2])
    return None if minutes is None else 60 * minutes


class ProgressLine:
    """One line per notebook, redrawn every few seconds while it runs: the time elapsed and the time expected."""

    def __init__(self, label: str, expected: float | None, every: float = 5.0):
        import threading

        from tqdm.auto import tqdm

        guess = f"of about {tqdm.format_interval(expected)} expected" if expected else "(no estimate yet)"
        fmt = "{desc}: {elapsed} elapsed " + guess + (" {bar:20}" if expected else "")
        self.bar = tqdm(total=expected or 1, desc=label, bar_format=fmt, leave=True)
        self.stop, self.every = threading.Event(), every
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.stop.wait(self.every):
            self.bar.n = min(self.bar.total, self.bar.format_dict["elapsed"])
            self.bar.refresh()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.n = min(self.bar.total, self.bar.format_dict["elapsed"])
        self.bar.close()


class NotebookFailed(RuntimeError):
    """A notebook failed; the message names it, the cell and where the executed copy was kept."""


def run_profile(
    name_or_path: str,
    only: list[str] | None = None,
    sets: dict | None = None,
    root: Path = REPO_ROOT,
    notebook_dir: Path = NOTEBOOK_DIR,
    run_name: str | None = None,
) -> list[dict]:
    """Execute the profile's notebooks in order with papermill; returns one record per notebook.
    ``run_name`` names the output folders instead of the profile (the reference run's smoke scale)."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    profile = load_profile(name_or_path)
    plan = plan_run(profile, only, sets, notebook_dir)  # validates everything before anything runs
    name = run_name or profile.name
    run_dir, figure_dir = root / "runs" / name, root / "figures" / name
    (run_dir / "results").mkdir(parents=True, exist_ok=True)
    figure_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "results" / "run_log.json"  # one entry per invocation, newest last
    history = json.loads(log.read_text()) if log.is_file() else []
    history = history if isinstance(history, list) else [history]
    entry = {"profile": profile.name, "only": only, "sets": sets, "notebooks": [], "finished": None}
    records = entry["notebooks"]
    for i, (nb, params) in enumerate(plan):
        params = {**params, "profile": profile.name, "run_dir": str(run_dir), "figure_dir": str(figure_dir)}
        out = run_dir / nb.name
        print(f"[kvshot] {profile.name}: running {nb.name} -> {out.relative_to(root)}", flush=True)
        t0 = time.perf_counter()
        label = f"[kvshot] {nb.name} ({i + 1}/{len(plan)})"
        try:
            with ProgressLine(label, expected_seconds(nb.name, history, profile)):
                papermill.execute_notebook(
                    str(nb),
                    str(out),
                    parameters=params,
                    cwd=str(nb.parent),
                    kernel_name="python3",
                    language="python",
                    progress_bar=False,
                )
        except PapermillExecutionError as e:
            raise NotebookFailed(
                f"{nb.name} failed in cell {e.cell_index} (execution count {e.exec_count}): {e.ename}: {e.evalue}\n"
                f"The executed notebook is kept at {out}; open it to see the traceback."
            ) from None
        records.append(
            {"notebook": nb.name, "seconds": round(time.perf_counter() - t0, 1), "output": str(out)}
        )
        print(f"[kvshot] {nb.name} done in {records[-1]['seconds']} s", flush=True)
        entry["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")  # saved after every notebook
        log.write_text(json.dumps([*history, entry], indent=1))
    return records


def add_cli(sub) -> None:
    p = sub.add_parser("run", help="run the numbered notebooks of a profile with papermill")
    p.add_argument(
        "--profile",
        default="default",
        help=f"a profile name ({', '.join(available_profiles())}) or a path to a YAML file",
    )
    p.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 00,02")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter (YAML-parsed value); repeatable",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory, disk and time per notebook this run needs (time from rates measured on a machine "
        "of this run's kind: benchmarks/results/gpu_check_*.json on a GPU, cpu_rates_*.json on a CPU) and run "
        "nothing; exit status 3 where this machine is short",
    )
    p.add_argument(
        "--force", action="store_true", help="run even where the estimate says memory or disk is short"
    )
    p.set_defaults(func=_cli_run)


def _cli_run(args) -> int:
    import sys

    only = [s for s in args.only.split(",") if s] if args.only else None
    try:
        sets = parse_sets(args.sets)
        if args.dry_run or not args.force:
            report, short = check_needs(args.profile, only, sets)
            if args.dry_run:
                print(f"kvshot run --profile {args.profile} --dry-run\n{report}")
            if short:
                print(f"kvshot run: {short} (--force runs anyway)", file=sys.stderr)
                return EXIT_MACHINE_SHORT
            if args.dry_run:
                return 0
        run_profile(args.profile, only, sets)
    except (ProfileError, NotebookFailed) as e:
        print(f"kvshot run: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_FAILURE if isinstance(e, NotebookFailed) else EXIT_USAGE
    return 0
