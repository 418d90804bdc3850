"""A carried row's stretches between restarts, and the machine each log row and each finished row is labelled
with (``kvshot_lib/training/stretches.py``, ``heldout.combined_table``, ``heldout.training_times``)."""

from types import SimpleNamespace

import pandas as pd
import pytest

from kvshot_lib.training import (
    TrainResult,
    by_stretch,
    combined_table,
    known_machines,
    stretches,
    training_times,
)

SECONDS = (10.0, 12.0, 14.0, 114.0, 116.0, 119.0)  # step 4 also took the restart's 100 s start-up
HISTORY = [dict(step=i + 1, seconds=t, tokens=1000 * (i + 1)) for i, t in enumerate(SECONDS)]
RESTART = dict(step=3, seconds=14.0, precision="bf16", cpu="B", bf16_isa="avx512_bf16", threads=2)


def test_progress_is_cut_at_each_restart_and_names_the_machine_of_each_stretch():
    """A carried row's history spans machines: one stretch per restart, each with the machine its restart
    logged; the first stretch (no restart names it) takes the machine of the earlier table saved at its end."""
    logs = dict(history=HISTORY, restarts=[RESTART])
    first, second = stretches(logs, here=dict(precision="bf16", cpu="C", bf16_isa="amx_bf16"))
    assert (first["from_step"], first["to_step"], first["seconds"], first["token_passes"]) == (
        0,
        3,
        14.0,
        6000,
    )
    assert (first["plain_steps"], first["seconds_per_step"], first["cpu"]) == (2, 2.0, None)
    assert (second["from_step"], second["to_step"], second["seconds"], second["token_passes"]) == (
        3,
        6,
        105.0,
        15000,
    )
    assert (second["plain_steps"], second["seconds_per_step"]) == (2, 2.5)
    assert second["token_passes_per_second"] == pytest.approx(11000 / 5) and second["cpu"] == "B"
    # no restart: the one stretch is this machine's (the state was saved here)
    (only,) = stretches(dict(history=logs["history"][:3]), here=dict(precision="fp32", cpu="C"))
    assert (only["cpu"], only["precision"], only["to_step"]) == ("C", "fp32", 3)
    progress = pd.DataFrame([dict(s, drafter="row", saved_step=6) for s in (first, second)])
    earlier = pd.DataFrame([dict(drafter="row", saved_step=3, precision="fp32", cpu="A", bf16_isa="none")])
    named = known_machines(progress, earlier)
    assert named["cpu"].tolist() == ["A", "B"] and named["precision"].tolist() == ["fp32", "bf16"]
    # the next session reads the table just written: each stretch keeps its machine, by the step it began at
    later = pd.DataFrame([dict(s, cpu=None) for s in named.to_dict("records")])
    assert known_machines(later, named)["cpu"].tolist() == ["A", "B"]
    # ... even where it ends further on (resumed from runs/ without a restart)
    longer = later.assign(to_step=[3, 9])
    assert known_machines(longer, named)["cpu"].tolist() == ["A", "B"]
    # each point takes the machine of the stretch that ran its step, not the machine that reads the state
    points = pd.DataFrame(dict(drafter="row", step=[0, 1, 3, 4, 6], cpu="here"))
    assert by_stretch(points, named, "step")["cpu"].tolist() == ["A", "A", "A", "B", "B"]


def _result(known=None, restarts=(RESTART,)):
    """A finished run of six steps (:data:`HISTORY`), finished on machine C, restarted at step 3 on B."""
    machine = dict(precision="fp32", device="cpu", cpu="C", bf16_isa="none", threads=2)
    return TrainResult(
        drafter=SimpleNamespace(cfg=SimpleNamespace(extra=dict(machine=machine))),
        out_dir=None,
        config=SimpleNamespace(name="row", paradigm="hidden", regime="ttt", target_kv="real", train_steps=6),
        logs=dict(
            history=HISTORY,
            eval=[dict(step=s, acc_0=0.5) for s in (0, 3, 6)],
            curve=[dict(step=0, budget_step=b, acc_0=0.5) for b in (0, 4)],
            restarts=list(restarts),
        ),
        train_seconds=119.0,
        known_stretches=known,
    )


def test_a_carried_runs_tables_name_the_machine_of_each_step_and_every_machine_of_the_row():
    """Each history, evaluation and curve row takes the machine of the stretch that ran its step (a curve point's
    is its budget's): the restart's for steps after it, the earlier table's for the first stretch, none where no
    record names one; never the machine that finished the run. The row's own label joins them in order."""
    earlier = pd.DataFrame([dict(drafter="row", from_step=0, precision="bf16", cpu="A", bf16_isa="amx_bf16")])
    run = _result(known=earlier)
    assert combined_table([run], "history")["cpu"].tolist() == ["A"] * 3 + ["B"] * 3
    assert combined_table([run], "eval")["cpu"].tolist() == ["A", "A", "B"]
    assert combined_table([run], "curve")["precision"].tolist() == ["bf16", "bf16"]
    (row,) = training_times([run]).to_dict("records")
    assert (row["precision"], row["cpu"], row["bf16_isa"]) == ("bf16", "A+B", "amx_bf16+avx512_bf16")
    assert row["device"] == "cpu"  # what no stretch says is the run's own
    # no earlier table: the first stretch's machine is unknown, not the finishing machine's
    unknown = combined_table([_result()], "eval")
    assert unknown["cpu"].isna().tolist() == [True, True, False] and "C" not in set(unknown["cpu"])
    assert training_times([_result()])["cpu"].item() == "B"
    # a run with no restart trained on one machine, its own
    plain = _result(restarts=())
    assert set(combined_table([plain], "history")["cpu"]) == {"C"}
    assert training_times([plain])["cpu"].item() == "C"
