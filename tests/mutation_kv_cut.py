"""Do the tests see a KV-only drafter that ignores the target's KV? (issue 12)

    python tests/mutation_kv_cut.py              # the drafter and KV tests, under the mutation (~1 min)
    python tests/mutation_kv_cut.py tests/ -q    # any pytest arguments (notebook kernels are not mutated)

The mutation: every call of ``KVDrafter.inject`` receives zeros in place of the target's K/V. Training (the
unroll) and decoding (``TrainedDraftSession._ingest_target``) get the target's K/V only through it, so the
KV-only drafter is cut off from the target's KV consistently in both, as a drafter that ignored the KV would
be; the hybrid drafter is left alone. The patch lives in this process only: nothing in the tree changes.

Lists every failure; exits 1 if a test of ``MUST_FAIL`` ran and passed, 0 otherwise.
"""

from __future__ import annotations

import sys

import pytest
import torch

DEPENDENCE = "tests/test_kv_dependence.py::test_{}_reads_the_target_kv_causally[{}]"
MUST_FAIL = (
    *(
        DEPENDENCE.format(where, variant)
        for where in ("training_unroll", "decode_session")
        for variant in ("kv-concat-1-0", "kv-linear_rope-2-0", "kv-concat-2-3")
    ),
    "tests/test_kv_copy_task.py::test_kv_drafter_learns_what_only_the_target_kv_holds",
    "tests/test_decoding.py::test_kv_drafter_beats_its_zeroed_kv_control_on_held_out_prompts",
)
DEFAULT_ARGS = [
    "tests/test_kv_dependence.py",
    "tests/test_kv_copy_task.py",
    "tests/test_kv_ablation.py",
    "tests/test_drafters.py",
    "tests/test_drafters_session.py",
    "tests/test_training_ttt.py",
    MUST_FAIL[-1],
    "-q",
    "-p",
    "no:cacheprovider",
]


def cut_target_kv() -> None:
    from kvshot_lib.drafters import KVDrafter

    inject = KVDrafter.inject

    def zeroed(self, keys, values, positions):
        return inject(self, torch.zeros_like(keys), torch.zeros_like(values), positions)

    KVDrafter.inject = zeroed


class Outcomes:
    def __init__(self):
        self.failed: list[str] = []
        self.passed: set[str] = set()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed.add(report.nodeid)


def main(args: list[str]) -> int:
    cut_target_kv()
    outcomes = Outcomes()
    pytest.main(args or DEFAULT_ARGS, plugins=[outcomes])
    print("\nUnder the mutation (target K/V zeroed for the KV-only drafter, in training and decoding):")
    for nodeid in outcomes.failed:
        print(f"  FAILED {nodeid}")
    missed = [t for t in MUST_FAIL if t in outcomes.passed]
    for nodeid in missed:
        print(f"  PASSED, BUT SHOULD FAIL: {nodeid}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
