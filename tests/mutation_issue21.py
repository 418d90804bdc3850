"""Do the tests of issue 21 fail on the bugs their names describe? Each mutant plants one bug (a text edit of
the library) in a copy of the working tree and runs, there:

* the **new** tests that must catch it (each must fail under the mutant);
* the **old** tests, as they were before issue 21 (``OLD_REV``), to show what they missed (``--old``, the
  default when that commit is in the repository);

and, once, both sets without any mutant (all must pass). Nothing in the working tree changes.

    python tests/mutation_issue21.py                  # every mutant (about 15 min on 2 busy cores)
    python tests/mutation_issue21.py sink_offset_dropped strict_residual_is_p   # some of them
    python tests/mutation_issue21.py --list           # the mutants and the tests that must catch them
    python tests/mutation_issue21.py --no-old         # skip the old tests

Prints one line per mutant (caught / SURVIVED, and whether the old tests passed under it); exits 1 if a
mutant survived, did not apply (its text is no longer in the library: update the mutant), or a test failed
without any mutant. The notebook mutants re-run one notebook of the smoke profile on top of the other
notebooks' outputs under ``runs/smoke`` (run ``make smoke`` first; ``KVSHOT_SMOKE_ONLY``, test_notebooks.py).
``tests/mutation_kv_cut.py`` is the older mutation check of issue 12; ``make mutants`` runs both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "8c4c2e9"  # main before issue 21: the tests as they were
ORIGINAL = "tests/test_specpv.py::test_strict_equals_plain_decoding_where_specpv_diverges"


@dataclass
class Mutant:
    name: str
    bug: str
    file: str  # below kvshot_lib/
    edits: list[tuple[str, str]]  # (text in the library, what replaces it); each text must occur once
    new: list[str]  # test node ids (a function runs all its parameters) of which each must fail
    old: list[str] = field(default_factory=list)  # the tests before issue 21 that the bug concerns
    smoke: str = ""  # a notebook to re-run under the mutant (KVSHOT_SMOKE_ONLY)


def resume(name):
    return f"tests/test_resume.py::{name}"


MUTANTS = [
    Mutant(
        "resume_from_step_0",
        "resume ignores the saved state and starts over from step 0",
        "training/resume.py",
        [("    meta = read_train_state(out)\n", "    meta = None\n")],
        [
            "tests/test_training.py::test_resume_is_exact_and_finished_runs_return_from_disk",
            resume("test_a_killed_run_resumes_to_the_uninterrupted_run"),
        ],
        ["tests/test_training.py::test_resume_is_exact_and_finished_runs_return_from_disk"],
    ),
    Mutant(
        "early_stopping_state_dropped",
        "the early-stopping state is not restored on resume (a fresh stopper)",
        "training/resume.py",
        [
            (
                "    meta = load_train_state(source.folder.parent, drafter, optimizer, stopper)",
                "    meta = load_train_state(source.folder.parent, drafter, optimizer)",
            )
        ],
        [resume("test_a_killed_run_resumes_to_the_uninterrupted_run")],
        ["tests/test_training.py::test_resume_is_exact_and_finished_runs_return_from_disk"],
    ),
    Mutant(
        "best_drafter_not_restored",
        "early stopping says it restored the best drafter but keeps the last weights",
        "training/convergence.py",
        [
            (
                "            drafter.load_state_dict({k: v.to(device) for k, v in self.best_state.items()}, strict=True)",
                "            pass",
            )
        ],
        ["tests/test_reference.py::test_early_stopping_restores_the_best_drafter"],
        ["tests/test_reference.py::test_early_stopping_restores_the_best_drafter"],
    ),
    Mutant(
        "sink_offset_dropped",
        "block summaries start at position 0, not after the sinks",
        "decoding/partial_kv.py",
        [
            (
                "bs, start = self.block_size, self.sink + have * self.block_size",
                "bs, start = self.block_size, have * self.block_size",
            ),
            (
                "new = keys[0, :, start : self.sink + n_blocks * bs]",
                "new = keys[0, :, start : n_blocks * bs]",
            ),
        ],
        ["tests/test_specpv.py::test_partial_cache_refresh_selects_top_blocks"],
        [
            "tests/test_specpv.py::test_partial_cache_refresh_selects_top_blocks",
            "tests/test_specpv.py::test_block_scores_bound_the_true_dot_products",
        ],
    ),
    Mutant(
        "partial_kv_kept_after_full_pass",
        "after a full pass, target-reading drafters keep the partial pass's K/V of the re-fed positions",
        "decoding/specpv.py",
        [
            (
                "            self.rewritten_from = F if self.rewritten_from is None else min(self.rewritten_from, F)",
                "            pass",
            )
        ],
        ["tests/test_specpv_drafters.py::test_after_a_full_pass_the_drafter_sees_the_exact_context"],
        [ORIGINAL],
    ),
    Mutant(
        "strict_residual_is_p",
        "strict mode replaces a rejected pending token by a sample of p, not of the residual max(0, p - q)",
        "decoding/verify.py",
        [
            (
                "    return k, int(sample(residual_probs(p[k], q[k]), gen))",
                "    return k, int(sample(p[k], gen))",
            )
        ],
        ["tests/test_specpv_sampling.py::test_strict_mode_follows_the_full_distribution_under_sampling"],
        [ORIGINAL],
    ),
    Mutant(
        "partial_verification_exact",
        "the partial cache keeps every block (partial verification is exact: the strict tests' premise fails)",
        "decoding/partial_kv.py",
        [("            if lay.n_candidates <= cfg.n_retrieved:", "            if True:")],
        ["tests/test_specpv.py::test_strict_checks_output_that_ends_on_partially_verified_tokens"],
        ["tests/test_specpv.py::test_strict_checks_output_that_ends_on_partially_verified_tokens"],
    ),
    Mutant(
        "final_check_skipped",
        "strict mode ends on partially verified tokens without checking them",
        "decoding/specpv.py",
        [("            if not (pv.strict and P > passes.F):", "            if True:")],
        ["tests/test_specpv.py::test_strict_checks_output_that_ends_on_partially_verified_tokens"],
        ["tests/test_specpv.py::test_strict_checks_output_that_ends_on_partially_verified_tokens"],
    ),
    Mutant(
        "third_draft_always_accepted",
        "the chain's rejection rule accepts every draft from depth 3 on",
        "decoding/verify.py",
        [
            (
                "    rejected = first_rejection(p[:n], q, torch.tensor(tree.tokens, device=p.device), gen)\n",
                "    rejected = first_rejection(p[:2], q[:2], torch.tensor(tree.tokens[:2], device=p.device), gen)\n",
            )
        ],
        ["tests/test_decoding_sampling.py::test_sampled_output_follows_the_target_distribution"],
        ["tests/test_decoding_sampling.py::test_sampled_output_follows_the_target_distribution"],
    ),
    Mutant(
        "accept_ignores_q",
        "the accept test is u < p(x) instead of u q(x) < p(x)",
        "decoding/verify.py",
        [("    return u * qx < px\n", "    return u < px\n")],
        ["tests/test_block_drafter.py::test_sampled_output_follows_the_target_distribution"],
        ["tests/test_block_drafter.py::test_sampled_output_follows_the_target_distribution"],
    ),
    Mutant(
        "corrupt_shard_kept",
        "a finished feature shard is kept without checking its hash",
        "corpus/features.py",
        [
            (
                '        if path.is_file() and _sha256(path) == shard["sha256"]:',
                "        if path.is_file():",
            )
        ],
        ["tests/test_features.py::test_corrupted_shard_is_redone"],
        ["tests/test_features.py::test_corrupted_shard_is_redone"],
    ),
    Mutant(
        "regeneration_restarts",
        "an interrupted regeneration starts over instead of resuming",
        "corpus/regenerate.py",
        [
            (
                '    done = {rec["id"] for shard in manifest["shards"] for rec in _read_shard(out / shard["file"])}',
                '    done, manifest["shards"], manifest["generated_tokens"] = set(), [], 0',
            )
        ],
        ["tests/test_regenerate.py::test_regeneration_resumes_after_an_interruption"],
        ["tests/test_regenerate.py::test_regeneration_resumes_after_an_interruption"],
    ),
    Mutant(
        "ngram_matches_the_prefix",
        "prompt lookup matches the text's first n tokens instead of its last n",
        "drafters/baselines.py",
        [
            (
                "            hits = (windows == seq[-n:]).all(-1).nonzero()[:, 0]",
                "            hits = (windows == seq[:n]).all(-1).nonzero()[:, 0]",
            )
        ],
        ["tests/test_decoding.py::test_ngram_drafter_is_lossless_and_helps_on_repetitive_text"],
        ["tests/test_decoding.py::test_ngram_drafter_is_lossless_and_helps_on_repetitive_text"],
    ),
    Mutant(
        "random_drafter_ignores_seed",
        "the random drafter's stream ignores its seed",
        "drafters/baselines.py",
        [
            (
                "            self.vocab_size, torch.Generator().manual_seed(self.seed * 100_003 + self._sessions)",
                "            self.vocab_size, torch.Generator().manual_seed(self._sessions)",
            )
        ],
        ["tests/test_decoding.py::test_random_drafter_sessions_are_reproducible"],
        ["tests/test_decoding.py::test_random_drafter_sessions_are_reproducible"],
    ),
    Mutant(
        "probe_ce_in_nats",
        "the probes' test table reports cross-entropy in nats under the name ce_bits",
        "diagnostics/probe_training.py",
        [
            (
                "                            ce_bits=float(ce[k][m].sum()) / math.log(2),",
                "                            ce_bits=float(ce[k][m].sum()),",
            )
        ],
        ["tests/test_probes.py::test_run_probes_end_to_end_on_a_tiny_target"],
        ["tests/test_probes.py::test_run_probes_end_to_end_on_a_tiny_target"],
    ),
    Mutant(
        "cli_drafter_error_as_traceback",
        "an early exit the loaded target refuses ends kvshot generate/bench with a traceback",
        "decoding/cli.py",
        [
            (
                "        return resolve_drafter(spec, target, seed)\n    except (ValueError, FileNotFoundError) as e:",
                "        return resolve_drafter(spec, target, seed)\n    except OSError as e:",
            )
        ],
        # (a checkpoint for other weights raises DrafterTargetMismatch, which cli.main also folds into one line)
        ["tests/test_cli_errors.py::test_an_early_exit_deeper_than_the_target_is_refused"],
        ["tests/test_decoding_harness.py::test_cli_rejects_bad_arguments_before_loading_anything"],
    ),
    Mutant(
        "cli_user_errors_as_traceback",
        "kvshot's user errors (a bad training setting, ...) end with a traceback",
        "cli.py",
        [("    except USER_ERRORS as e:", "    except ():")],
        ["tests/test_cli_errors.py::test_bad_settings_and_counts_are_refused_before_loading"],
        ["tests/test_training.py::test_bad_parameters_are_refused"],
    ),
    Mutant(
        "cli_target_checked_after_loading",
        "a checkpoint for another target is only refused once the target has loaded",
        "decoding/cli.py",
        [('    if arch and (arch["fingerprint"], arch["vocab_size"]) != trained_for:', "    if False:")],
        ["tests/test_cli_errors.py::test_a_checkpoint_for_another_target_is_refused_before_loading"],
        ["tests/test_decoding_harness.py::test_cli_rejects_bad_arguments_before_loading_anything"],
    ),
    Mutant(
        "cost_model_full_buffer",
        "the cost model's partial cycles run on the budget plus the whole buffer, not its mean",
        "evaluation/specpv_cost.py",
        [("forward(budget + 8 + pend / 2, drafted + 1)", "forward(budget + 8 + pend, drafted + 1)")],
        ["tests/test_specpv_cost.py::test_per_token_seconds_by_hand"],
    ),
    Mutant(
        "first_divergence_longer_length",
        "first_divergence of a prefix is the longer length",
        "evaluation/specpv_fidelity.py",
        [("min(len(tokens), len(reference))", "max(len(tokens), len(reference))")],
        ["tests/test_specpv_cost.py::test_first_divergence_by_hand"],
    ),
    Mutant(
        "nb01_information_gain_sign",
        "notebook 01's information gain is CE(probe) - CE(emb)",
        "diagnostics/probe_stats.py",
        [("diff = emb[:, steps.index(step)] - ce[:, c]", "diff = ce[:, c] - emb[:, steps.index(step)]")],
        ["tests/test_notebooks.py::test_saved_tables_of_notebook_01"],
        smoke="01",
    ),
    Mutant(
        "nb04_verdict_sign",
        "notebook 04's verdict subtracts the drafter's error from the stale query's",
        "diagnostics/query_tables.py",
        [('diff = wide["drafter"] - wide["stale"]', 'diff = wide["stale"] - wide["drafter"]')],
        ["tests/test_notebooks.py::test_saved_tables_of_notebook_04"],
        smoke="04",
    ),
    Mutant(
        "nb07_mat_without_bonus",
        "notebook 07's speed table counts MAT without the bonus token",
        "evaluation/metrics.py",
        [
            (
                "    return (n_accepted + n_cycles) / n_cycles if n_cycles else math.nan",
                "    return n_accepted / n_cycles if n_cycles else math.nan",
            )
        ],
        ["tests/test_notebooks.py::test_saved_tables_of_notebook_07"],
        smoke="07",
    ),
]


def copy_tree(dest: Path, rev: str | None = None) -> None:
    """The working tree's files (tracked and untracked, not ignored), or the ``tests/`` of commit ``rev``."""
    if rev is not None:
        archive = subprocess.run(["git", "archive", rev, "tests"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        return
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for f in (x.decode() for x in files if x):
        if f.startswith("figures/") or not (ROOT / f).is_file():
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


def apply(mutant: Mutant, tree: Path) -> str:
    """Plant the mutant in ``tree``; returns an error message if its text is not in the library (once)."""
    path = tree / "kvshot_lib" / mutant.file
    text = path.read_text()
    for old, new in mutant.edits:
        if text.count(old) != 1:
            return f"{mutant.file} holds {text.count(old)} copies of {old.strip()[:70]!r} (update the mutant)"
        text = text.replace(old, new)
    path.write_text(text)
    return ""


def run_tests(tree: Path, tests_dir: str, ids: list[str], smoke: str = "") -> dict[str, str]:
    """Run the test functions ``ids`` (``tests/<file>::<function>``) found under ``tree/tests_dir``; returns
    ``{id: "passed" | "failed" | "missing"}`` (failed: any parameter failed or errored)."""
    nodes = [i.replace("tests/", f"{tests_dir}/", 1) for i in ids]
    report = tree / "report.xml"
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("KVSHOT_CACHE", str(_cache_dir()))
    if smoke:
        env["KVSHOT_SMOKE_ONLY"] = smoke
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodes]
    subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    outcome = dict.fromkeys(ids, "missing")
    if not report.is_file():
        return outcome
    for case in ET.parse(report).getroot().iter("testcase"):
        module, name = case.get("classname", "").split(".")[-1], case.get("name", "").split("[")[0]
        for i in ids:
            file, function = i.split("::")
            if Path(file).stem == module and function == name:
                failed = case.find("failure") is not None or case.find("error") is not None
                if failed:
                    outcome[i] = "failed"
                elif case.find("skipped") is None and outcome[i] == "missing":
                    outcome[i] = "passed"
    report.unlink()
    return outcome


def _cache_dir() -> Path:
    sys.path.insert(0, str(ROOT))
    from kvshot_lib.target import cache_dir

    return cache_dir()


def prepare(tree: Path, mutant: Mutant | None, old: bool) -> str:
    copy_tree(tree)
    if old:
        (tree / "old").mkdir()
        copy_tree(tree / "old", OLD_REV)
    if mutant is not None and mutant.smoke:
        smoke = ROOT / "runs" / "smoke"
        if not (smoke / "results" / "run_log.json").is_file():
            return "runs/smoke has no finished smoke run: run `make smoke` first"
        shutil.copytree(smoke, tree / "runs" / "smoke")
    return apply(mutant, tree) if mutant is not None else ""


def check(mutant: Mutant | None, old: bool) -> tuple[dict, dict, str]:
    with tempfile.TemporaryDirectory(prefix="kvshot-mutant-") as tmp:
        tree = Path(tmp)
        error = prepare(tree, mutant, old)
        if error:
            return {}, {}, error
        mutants = [mutant] if mutant is not None else [m for m in MUTANTS if not m.smoke]
        new_ids = list(dict.fromkeys(i for m in mutants for i in m.new))
        smoke = mutant.smoke if mutant is not None else ""
        new = run_tests(tree, "tests", new_ids, smoke)
        old_ids = list(dict.fromkeys(i for m in mutants for i in m.old))
        was = run_tests(tree, "old/tests", old_ids) if old and old_ids else {}
        return new, was, ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--no-old", action="store_true", help="skip the tests as they were before issue 21")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without mutants")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = sorted(set(args.names) - {m.name for m in MUTANTS})
    if unknown:
        print(f"unknown mutants {unknown}; --list shows them")
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n    caught by {', '.join(m.new)}")
        return 0
    old = not args.no_old and subprocess.run(["git", "cat-file", "-e", OLD_REV], cwd=ROOT).returncode == 0
    bad = 0
    if not args.no_baseline:
        new, was, _ = check(None, old)
        broken = [i for i, o in new.items() if o != "passed"]
        print("without mutants: " + ("every test passes" if not broken else f"NOT PASSING: {broken}"))
        stale = [i for i, o in was.items() if o != "passed"]  # written for the library before issue 21
        if stale:
            print(
                f"  (old tests that fail on today's library without any mutant, so 'old: failed' says nothing: {stale})"
            )
        bad += len(broken)
    for m in chosen:
        new, was, error = check(m, old)
        if error:
            print(f"{m.name}: DOES NOT APPLY: {error}")
            bad += 1
            continue
        missed = [i for i, o in new.items() if o != "failed"]
        if m.smoke and not args.no_baseline:  # the notebook's tables without the mutant
            clean, _, _ = check(Mutant(m.name, "", m.file, [], m.new, smoke=m.smoke), False)
            if any(o != "passed" for o in clean.values()):
                print(f"{m.name}: the notebook test fails WITHOUT the mutant: {clean}")
                bad += 1
        verdict = "caught" if not missed else f"SURVIVED ({', '.join(missed)}: {[new[i] for i in missed]})"
        olds = ", ".join(f"{i.split('::')[1]} {o}" for i, o in was.items()) if was else "no old test"
        print(f"{m.name}: {verdict} by {', '.join(i.split('::')[1] for i in m.new)} | old: {olds}")
        bad += bool(missed)
    print("every mutant caught" if not bad else f"{bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
