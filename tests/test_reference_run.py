"""The reference run on one machine (``kvshot_lib.reference``), at smoke scale on the CPU: trained rows and the
MT-bench evaluation land in the run's tables and figures, Table 5 is built from them, and a row trained again
replaces its old one."""

import pandas as pd
import pytest

from kvshot_lib.reference import PlanError, load_plan, run_reference


def test_a_smoke_run_writes_table_5_and_its_figures(tmp_path):
    plan = load_plan("reference", smoke=True)
    record = run_reference(plan, "cpu", ("train", "eval"), ["hidden-ttt"], root=tmp_path, progress=False)
    assert record["trained"] == ["hidden-ttt"]
    assert {(d["drafter"], d["mode"]) for d in record["evaluated"]} >= {
        ("hidden-ttt", "tree"),
        ("ngram", "chain"),
    }
    data = tmp_path / "figures" / "reference" / "data"
    per_step = pd.read_csv(data / "per_step_accuracy.csv")
    assert set(per_step["drafter"]) == {"hidden-ttt"} and list(per_step["draft_step"]) == list(range(7))
    table = pd.read_csv(data / "reference_table.csv").set_index("drafter")
    acc = per_step.sort_values("draft_step")["accuracy"].cumprod()  # reach: acc_0 * ... * acc_k
    assert table.loc["hidden-ttt", "heldout_mat"] == pytest.approx(1 + acc.sum())
    assert "mtbench_mat" in table and (tmp_path / "runs" / "reference" / "drafters" / "hidden-ttt").is_dir()
    for fig in ("02_per_step_accuracy", "03_acceptance_by_step", "03_mat_by_drafter"):
        assert (tmp_path / "figures" / "reference" / f"{fig}.png").is_file()
    run_reference(plan, "cpu", ("train",), ["hidden-ttt"], root=tmp_path, progress=False, train_steps=2)
    assert len(pd.read_csv(data / "training_history.csv")) == 2  # the rerun replaced the row's longer history
    with pytest.raises(PlanError, match="steps"):
        run_reference(plan, "cpu", ("fly",), root=tmp_path)
