"""The reference run on a time-boxed remote GPU: one command per device call, and the steps around them here.

The run itself is ``python -m kvshot_lib.reference`` (any machine that can run it whole); this driver is its
optional transport (the ``transport`` package beside it) for a bare device that reaches nothing, runs a
command for 10 minutes and carries 64 MiB per call.

    python scripts/reference/run_job.py plan                  # the device calls to make, in order (with carry)
    python scripts/reference/run_job.py pack                  # here: write the payload parts (runs/reference-payload/)
    python3 scripts/reference/run_job.py stage PART           # device: keep one part; the last one installs
    python3 scripts/reference/run_job.py job NAME             # device: run job NAME of the plan into $OUT/NAME/
    python scripts/reference/run_job.py merge DIR [DIR ...]   # here: job outputs -> runs/, figures/, checkpoints/
    python scripts/reference/run_job.py checkpoints           # here: committed checkpoints -> runs/<profile>/drafters/
    python scripts/reference/run_job.py dry-run               # here: the whole path on the CPU, tiny-llama

Every command checks its arguments before long work: an unknown job or row, a time budget over the device's
10 minutes, a missing $OUT, CUDA asked for but absent, assets not staged. ``--smoke`` uses the profile's
``smoke`` overrides (a tiny random target on the CPU); ``--local`` uses this machine's installed asset packages
instead of staged ones. The package is imported from this checkout (no install needed on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the transport package
_site = (
    Path(os.environ.get("KVSHOT_CACHE") or ROOT / "data" / "cache") / "reference-stage" / "assets" / "site"
)
if _site.is_dir():  # the staged gguf package, before transformers looks for it
    sys.path.insert(0, str(_site))

DEVICE_LIMIT_MIN = 9.5  # a device command runs 10 minutes at most; the job needs a little to start and return


def fail(msg: str) -> None:
    print(f"run_job.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load(args):
    from kvshot_lib.reference import PlanError, load_plan

    try:
        return load_plan(args.profile, smoke=args.smoke)
    except (PlanError, ValueError) as e:
        fail(str(e))


# ------------------------------------------------------------------------------------------------ commands


def cmd_plan(args) -> None:
    """Print the device calls in order: the stage calls, then one call per job; then the merge."""
    plan = load(args)
    pack_json = ROOT / "runs" / "reference-payload" / "pack.json"
    parts = json.loads(pack_json.read_text())["parts"] if pack_json.is_file() else None
    print(
        f"# profile {plan.profile}{' (smoke)' if plan.smoke else ''}: {len(plan.rows)} rows, {len(plan.jobs)} jobs"
    )
    if parts is None:
        print("# no payload yet: run `python scripts/reference/run_job.py pack` first (then plan again)")
        parts = ["runs/reference-payload/part-<id>-1of<n>.bin", "..."]
    print(
        "# 1. stage, back to back (a warm machine keeps them 30 s after a call; a fresh machine needs them again)"
    )
    for p in parts:
        print(
            json.dumps(
                dict(command=f"python3 scripts/reference/run_job.py stage {p}", carry=[p], timeout_s=600)
            )
        )
    print("# 2. the jobs, in priority order; each returns $OUT/<job>/ (tables.tar.gz, log.txt, checkpoints)")
    for job in plan.jobs.values():
        cmd = (
            f"set -o pipefail; mkdir -p $OUT/{job.name}; PYTHONUNBUFFERED=1 python3 scripts/reference/run_job.py "
            f"job {job.name} 2>&1 | tee $OUT/{job.name}/log.txt"
        )
        needs = (
            job.rows
            if job.kind == "eval"
            else [plan.row(r).init_row for r in job.rows if plan.row(r).init_row]
        )
        call = dict(command=cmd, timeout_s=600)
        if needs:  # checkpoints trained on another machine travel in runs/ (merge puts them there)
            call["carry"] = [f"runs/{plan.profile}/drafters/{r}" for r in dict.fromkeys(needs)]
        print(json.dumps(call) + f"  # {job.kind}: {', '.join(job.rows) or 'ShareGPT'}")
    print(
        "# 3. here, after each job: python scripts/reference/run_job.py merge <files_at>; commit figures/, checkpoints/, data/"
    )


def cmd_pack(args) -> None:
    from transport import payload

    plan = load(args)
    out = Path(args.out) if args.out else payload.PAYLOAD_DIR
    rec = payload.pack(plan, out, max_call_mib=args.max_call_mib, part_mib=args.part_mib)
    mib = payload.MiB
    print(
        f"payload {rec['pack_id']}: {rec['payload_bytes'] / mib:.1f} MiB in {len(rec['parts'])} parts of "
        f"<= {rec['part_bytes'] / mib:.1f} MiB (working tree {rec['tree_bytes'] / mib:.1f} MiB)"
    )
    for p in rec["parts"]:
        print(" ", p)


def cmd_stage(args) -> None:
    from transport import payload

    try:
        status = payload.stage(Path(args.part))
    except payload.StageError as e:
        fail(str(e))
    print(json.dumps(status, indent=1))
    if status.get("weights_match") is False:
        print("WARNING: this machine dequantized the GGUF to other weights than the packer's; see READY.json")


def cmd_job(args) -> None:
    from transport import jobs, outputs, payload

    from kvshot_lib.reference import PlanError, run

    plan = load(args)
    try:
        job = plan.job(args.name)
        if args.rows:
            job.rows = [plan.row(r).name for r in args.rows.split(",")]
    except PlanError as e:
        fail(str(e))
    minutes = args.minutes or job.minutes
    if not 0 < minutes <= DEVICE_LIMIT_MIN and not args.local:
        fail(
            f"--minutes must be in (0, {DEVICE_LIMIT_MIN}]: a device command runs 10 minutes at most, got {minutes}."
        )
    out = args.out or os.environ.get("OUT")
    if not out:
        fail("no output folder: the device sets $OUT; elsewhere pass --out DIR.")
    device = args.device or plan.device
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        fail(
            f"device {device!r} was asked for but CUDA is not available here; pass --device cpu (with --smoke)."
        )
    torch.set_num_threads(args.threads or torch.get_num_threads())
    try:
        print(json.dumps(payload.activate(local=args.local)))
    except payload.StageError as e:
        fail(str(e))
    try:  # the checkpoints a job starts from or measures must exist before it loads anything
        for r in job.rows:
            row = plan.row(r)
            if job.kind == "eval":
                run.checkpoint_path(plan, r, outputs.runs_dir())
            elif row.init_row and row.init_row not in job.rows:
                run.init_path(plan, row, outputs.runs_dir())
    except PlanError as e:
        fail(str(e))
    result = jobs.run(plan, job, Path(out), device, T0, minutes, progress=not args.quiet)
    print(json.dumps(result, indent=1, default=str)[-4000:])
    print(f"job {job.name} done in {time.perf_counter() - T0:.0f} s; output in {Path(out) / job.name}")


def cmd_merge(args) -> None:
    from transport import merge

    plan = load(args)
    missing = [s for s in args.sources if not Path(s).exists()]
    if missing:
        fail(f"no such job output folders: {missing}")
    target = None
    if args.verify:
        from kvshot_lib.target import load_target

        target = load_target(plan.target, device="cpu", dtype="float32")
    rec = merge.merge(plan, args.sources, root=Path(args.root), name=args.name, verify_target=target)
    print(json.dumps(rec, indent=1, default=str))


def cmd_checkpoints(args) -> None:
    """Copy the committed checkpoints (checkpoints/<profile>/) to runs/<profile>/drafters/, where notebooks 03
    and 06 look for drafters, and load each on the CPU with the plan's target (a wrong one is refused)."""
    from kvshot_lib.drafters import load_drafter
    from kvshot_lib.target import load_target

    plan = load(args)
    src = ROOT / "checkpoints" / plan.profile
    if not src.is_dir():
        fail(f"no committed checkpoints in {src}: merge a GPU job's output first.")
    target = load_target(plan.target, device="cpu", dtype="float32")
    for folder in sorted(p for p in src.iterdir() if (p / "config.json").is_file()):
        d = load_drafter(folder, target)
        dest = ROOT / "runs" / plan.profile / "drafters" / folder.name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(folder, dest)
        print(f"{folder.name}: {d.cfg.paradigm}, {d.n_trainable():,} parameters -> {dest.relative_to(ROOT)}")


def cmd_dry_run(args) -> None:
    """The whole path on this CPU at smoke scale: pack, a bare copy of the working tree staged part by part, every
    job as its own process with a fresh $OUT, the limits of what comes back, the merge, and the redraw."""
    from transport import outputs, payload

    from kvshot_lib.reference import load_plan

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    plan = load_plan(args.profile, smoke=True)
    rec = payload.pack(plan, work / "payload", part_mib=args.part_mib)
    print(f"packed {len(rec['parts'])} parts of {rec['part_bytes'] / payload.MiB:.0f} MiB", flush=True)
    device = (
        work / "device"
    )  # what the device tool sends: tracked files and untracked ones git does not ignore
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in (p.decode() for p in listed if p):
        if (ROOT / rel).is_file():
            (device / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, device / rel)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSHOT_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    calls = []
    for part in rec["parts"]:
        carried = device / "runs" / "reference-payload" / Path(part).name
        carried.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(part, carried)
        calls.append(["stage", str(carried.relative_to(device))])
    names = args.jobs.split(",") if args.jobs else list(plan.jobs)
    calls += [
        ["job", n, "--smoke", "--device", "cpu", "--threads", str(args.threads), "--quiet"] for n in names
    ]
    returned = []
    for i, call in enumerate(calls):
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "scripts/reference/run_job.py", *call], cwd=device, env=dict(env, OUT=str(out)),
            capture_output=True, text=True,
        )  # fmt: skip
        print(
            f"[{i + 1}/{len(calls)}] {' '.join(call[:2])}: exit {done.returncode} in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-6000:])
            fail(f"dry run: {' '.join(call)} failed")
        outputs.check_limits(out)  # what would not come back from the device
        back = work / "returned" / f"{i:02d}"
        shutil.copytree(out, back)
        returned.append(back)
    merged = work / "merged"
    subprocess.run(
        [
            sys.executable,
            __file__,
            "merge",
            *map(str, returned),
            "--smoke",
            "--root",
            str(merged),
            "--verify",
        ],
        check=True,
    )
    figs = merged / "figures" / plan.profile
    redrawn = work / "redrawn"
    subprocess.run(
        [sys.executable, "-m", "kvshot_lib.cli", "figures", "--profile", str(figs), "--out", str(redrawn)],
        check=True,
    )
    same = [p.name for p in figs.glob("*.png") if (redrawn / p.name).read_bytes() == p.read_bytes()]
    print(
        f"dry run done: {len(calls)} device calls, merged into {merged}; {len(same)} figures redrawn byte for byte"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="reference-gpu")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--profile", default=argparse.SUPPRESS)
        p.add_argument(
            "--smoke", action="store_true", help="the profile's smoke overrides (tiny target, CPU)"
        )

    p = sub.add_parser("plan", help="print the device calls in order")
    common(p)
    p = sub.add_parser("pack", help="write the payload parts for the stage calls")
    common(p)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--max-call-mib", type=float, default=62.0, help="what one device call may carry, tree included"
    )
    p.add_argument("--part-mib", type=float, default=None, help="force the part size")
    p = sub.add_parser("stage", help="device: keep one payload part (the last one installs)")
    p.add_argument("part")
    p = sub.add_parser("job", help="device: run one job of the plan")
    common(p)
    p.add_argument("name")
    p.add_argument("--rows", default=None, help="comma-separated rows instead of the job's own")
    p.add_argument(
        "--minutes", type=float, default=None, help="wall-clock budget from the start of this command"
    )
    p.add_argument("--device", default=None, help="default: the profile's (cuda)")
    p.add_argument("--out", default=None, help="default: $OUT")
    p.add_argument(
        "--local", action="store_true", help="use this machine's asset packages, not staged assets"
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p = sub.add_parser(
        "merge", help="job outputs -> runs/<name>/, figures/<name>/, checkpoints/<name>/, data/<name>/"
    )
    common(p)
    p.add_argument("sources", nargs="+")
    p.add_argument("--root", default=str(ROOT), help="where runs/, figures/, checkpoints/ and data/ are")
    p.add_argument("--name", default=None, help="the run's name (default: the profile's)")
    p.add_argument("--verify", action="store_true", help="load every imported checkpoint on the CPU")
    p = sub.add_parser(
        "checkpoints", help="committed checkpoints -> runs/<profile>/drafters/ (for notebooks 03, 06)"
    )
    common(p)
    p = sub.add_parser("dry-run", help="the whole path on this CPU at smoke scale")
    p.add_argument("--work", default="/tmp/kvshot-reference-dry")
    p.add_argument("--jobs", default=None, help="comma-separated jobs (default: all)")
    p.add_argument("--part-mib", type=float, default=40.0)
    p.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not hasattr(args, "smoke"):
        args.smoke = False
    commands = dict(plan=cmd_plan, pack=cmd_pack, stage=cmd_stage, job=cmd_job, merge=cmd_merge)
    commands.update({"checkpoints": cmd_checkpoints, "dry-run": cmd_dry_run})
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
