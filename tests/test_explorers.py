"""The explorers: their widgets build, a control's change redraws, and every number they show is the saved
table's (and, for attention, the distributions drawn give back the saved metrics)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from kvshot_lib.diagnostics import QueryErrorTables, explorers, measure_sequence
from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.evaluation import metrics


@pytest.fixture(scope="module")
def acceptance_table():
    rows = []
    counts = {
        "kv-ttt": ([100, 40, 20, 5], [40, 20, 5, 1]),
        "hidden-ttt": ([100, 60, 30, 30], [60, 30, 24, 10]),
    }
    for name, (att, acc) in counts.items():
        for mode in ("chain", "tree"):
            for temp in (0.0, 1.0):
                for rec in metrics.acceptance_by_step(att, acc):
                    rows.append(
                        dict(
                            drafter=name,
                            paradigm=name.split("-")[0],
                            regime="ttt",
                            mode=mode,
                            temperature=temp,
                            **rec,
                        )
                    )
    return pd.DataFrame(rows)


def test_acceptance_explorer_builds_redraws_and_shows_the_table(acceptance_table):
    ex = explorers.AcceptanceExplorer(acceptance_table, min_attempts=20)
    assert ex.n_draws == 1 and "chain" in ex.caption.value
    lines = ex.lines()
    assert set(lines) == {"kv-ttt", "hidden-ttt"}
    kv = lines["kv-ttt"]
    assert kv["step"].tolist() == [0, 1, 2]  # step 3 had 5 attempts: hidden
    assert np.allclose(kv["alpha_conditional"], [0.4, 0.5, 0.25])
    fig = ex.figure()
    drawn = {line.get_label(): line.get_ydata() for line in fig.axes[0].lines}
    assert np.allclose(drawn["kv-ttt"], kv["alpha_conditional"])
    assert np.allclose(fig.axes[1].lines[0].get_ydata(), lines[fig.axes[0].lines[0].get_label()]["p_reach"])
    ex.controls["drafters"].value = ("hidden-ttt",)
    assert ex.n_draws == 2 and "kv-ttt" not in ex.caption.value
    ex.controls["mode"].value = "tree"
    assert ex.n_draws == 3 and "tree" in ex.caption.value
    assert set(ex.lines()) == {"hidden-ttt"}


@pytest.fixture(scope="module")
def attention_case(tiny_llama):
    cfg = drafter_config_for(tiny_llama, "kv", query_group=1, draft_vocab_size=512, name="kv-x")
    d = build_drafter(cfg, tiny_llama, torch.arange(512), seed=0)
    ids = torch.randint(0, 49152, (26,), generator=torch.Generator().manual_seed(0))
    se = measure_sequence(tiny_llama, d, ids, 14, 3, "q1-t1", keep_maps=True)
    tables = QueryErrorTables(dict(drafter="kv-x", paradigm="kv", regime="ttt", kv_mode="concat"))
    tables.add(se)
    tokens = [f"tok{i}" for i in range(len(ids))]
    return se, tokens, tables.positions()


def test_attention_explorer_shows_the_saved_metrics_of_what_it_draws(attention_case):
    se, tokens, positions = attention_case
    ex = explorers.AttentionExplorer({"kv-x": se}, tokens, positions)
    assert ex.n_draws == 1
    for head, step in ((0, 0), (3, 2)):
        ex.controls["head"].value = head
        ex.controls["step"].value = step
        s = ex.selection()
        m = ex.metrics()
        saved = positions[
            (positions["layer"] == s["layer"])
            & (positions["head"] == head)
            & (positions["step"] == step)
            & (positions["anchor"] == s["anchor"])
            & (positions["level"] == "head")
        ]
        assert len(m) == len(saved) == 8  # 4 estimators x 2 sink variants
        for (est, variant), row in m.iterrows():
            ref = saved[(saved["estimator"] == est) & (saved["variant"] == variant)].iloc[0]
            assert row["out_err"] == pytest.approx(ref["out_err"], nan_ok=True)
        # the distributions drawn give back the saved KL and unavailable mass
        target, drafter, t, p = ex.distributions()
        p_star = target[: t + 1] / target[: t + 1].sum()
        kl = sum(a * math.log2(a / b) for a, b in zip(p_star, drafter[: t + 1]) if a > 0)
        assert kl == pytest.approx(m.loc[("drafter", "with_sink"), "kl_bits"], rel=1e-4, abs=1e-6)
        assert target[t + 1 : p + 1].sum() == pytest.approx(
            m.loc[("drafter", "with_sink"), "unavailable_mass"], abs=1e-5
        )
        fig = ex.figure()
        heights = [bar.get_height() for bar in fig.axes[1].patches]
        assert heights[0] == pytest.approx(drafter[0])  # the sink is always drawn first
    assert ex.n_draws == 3 and "head 3" in ex.caption.value  # head 0 and step 0 were already chosen


def test_show_draws_a_static_figure_in_batch_runs(attention_case, acceptance_table, monkeypatch, capsys):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert not explorers.has_widget_frontend()
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/notebooks/04.ipynb")
    assert explorers.has_widget_frontend()
    monkeypatch.setenv("KVSHOT_STATIC_EXPLORERS", "1")
    assert not explorers.has_widget_frontend()
    ex = explorers.show(explorers.AcceptanceExplorer(acceptance_table))
    assert "Figure" in capsys.readouterr().out  # a figure was displayed, not the widget
    explorers.show(ex, interactive=True)
    assert "VBox" in capsys.readouterr().out
