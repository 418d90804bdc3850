"""Learning curves: WSD decay branches leave the main run untouched and equal a separate run of that budget;
the saturating fit recovers a known asymptote; the gap trend has the sign of a known slope."""

import numpy as np
import pytest
import torch

from kvshot_lib.corpus import extract_features, tokenize_sharegpt
from kvshot_lib.evaluation import fit_saturating, gap_trend
from kvshot_lib.training import (
    StoreBatches,
    TrainConfig,
    curve_steps,
    lr_factor,
    plateau_step,
    read_train_state,
    train_drafter,
)


@pytest.fixture(scope="module")
def stores(tiny_llama, tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("features")
    train = tokenize_sharegpt(tokenizer, "train", 6, 40, seed=0)
    held = tokenize_sharegpt(tokenizer, "eval", 2, 40, seed=0)
    return extract_features(tiny_llama, train, out_dir=root / "t"), extract_features(
        tiny_llama, held, out_dir=root / "e"
    )


def cfg(**kw):
    base = dict(
        paradigm="hidden",
        regime="ttt",
        ttt_steps=3,
        draft_vocab_size=128,
        lr=3e-3,
        warmup_steps=2,
        eval_every=0,
        eval_sequences=2,
        probe_every=0,
        save_every=0,
        schedule="wsd",
        decay_fraction=0.1,
        mixed_precision="no",
    )
    return TrainConfig(**{**base, **kw})


def test_curve_steps_are_log_spaced_and_wsd_decays_at_the_end():
    assert curve_steps(1600, 5) == [100, 200, 400, 800, 1600]
    assert curve_steps(100, 0) == []
    c = cfg(train_steps=40, eval_every=0)
    factors = [lr_factor(c, s) for s in range(40)]
    assert factors[:2] == [0.5, 1.0]  # warmup over 2 steps
    assert all(f == 1.0 for f in factors[2:36])  # stable
    assert factors[36:] == pytest.approx([1 - 0.9 * (i + 1) / 4 for i in range(4)])  # decay to 0.1
    assert factors[-1] == pytest.approx(0.1)


def test_decay_branches_leave_the_main_run_unchanged_and_equal_a_separate_run(tiny_llama, stores, tmp_path):
    train, held = stores
    plain = train_drafter(tiny_llama, train, held, cfg(train_steps=40), tmp_path / "plain", progress=False)
    curved = train_drafter(
        tiny_llama, train, held, cfg(train_steps=40, curve_points=3), tmp_path / "curved", progress=False
    )
    # the branches ran and were undone: the main run's losses and weights are those of the plain run
    assert [r["loss"] for r in curved.logs["history"]] == [r["loss"] for r in plain.logs["history"]]
    for (k, a), b in zip(plain.drafter.state_dict().items(), curved.drafter.state_dict().values()):
        assert torch.equal(a, b), k
    points = curved.logs["curve"]
    assert [p["budget_step"] for p in points] == [10, 20, 40]
    assert [p["branch_steps"] for p in points] == [1, 2, 4]
    # the point at 20 steps = a separate run of 22 steps whose own final decay is those 2 steps
    alone = train_drafter(
        tiny_llama,
        train,
        held,
        cfg(train_steps=22, decay_fraction=2 / 22, eval_every=22),
        tmp_path / "alone",
        progress=False,
    )
    final = alone.logs["eval"][-1]
    assert [round(r["lr"] / 3e-3, 6) for r in alone.logs["history"][-2:]] == [0.55, 0.1]  # its own decay
    point = points[1]
    for k in range(3):
        assert point[f"acc_{k}"] == final[f"acc_{k}"]
        assert point[f"ce_{k}"] == pytest.approx(final[f"ce_{k}"], rel=1e-6)
    assert point["tokens"] == sum(r["tokens"] for r in alone.logs["history"])


def test_a_run_killed_after_a_decay_branch_resumes_without_training_it_again(
    tiny_llama, stores, tmp_path, monkeypatch
):
    """The state is saved after each branch (here the only saves: save_every is past the run's end), so a run
    killed after its second branch resumes from that step and ends as the uninterrupted run, branches included."""
    from kvshot_lib.training import loop

    c = cfg(train_steps=40, curve_points=3, save_every=1000)
    whole = train_drafter(tiny_llama, *stores, c, tmp_path / "whole", progress=False)
    real_branch, real_batch, branches = loop._decay_branch, StoreBatches.batch, []

    def branch(*args, **kwargs):
        point = real_branch(*args, **kwargs)
        branches.append(point["budget_step"])
        return point

    def batch(self, step):  # killed at the first batch the main loop asks for after the second branch
        if len(branches) == 2:
            raise KeyboardInterrupt
        return real_batch(self, step)

    monkeypatch.setattr(loop, "_decay_branch", branch)
    monkeypatch.setattr(StoreBatches, "batch", batch)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_llama, *stores, c, tmp_path / "k", progress=False)
    monkeypatch.setattr(StoreBatches, "batch", real_batch)
    state = read_train_state(tmp_path / "k")
    assert branches == [10, 20] and state is not None and state["step"] == 20
    resumed = train_drafter(tiny_llama, *stores, c, tmp_path / "k", progress=False)
    assert branches == [10, 20]  # no branch trained again (40 is the run's own end, not a branch)
    assert [r["loss"] for r in resumed.logs["history"]] == [r["loss"] for r in whole.logs["history"]]
    assert [(p["budget_step"], p["acc_0"]) for p in resumed.logs["curve"]] == [
        (p["budget_step"], p["acc_0"]) for p in whole.logs["curve"]
    ]


def test_fit_recovers_a_known_asymptote_within_its_interval():
    rng = np.random.default_rng(0)
    a, b, c = 0.62, 3.0, 0.3
    tokens = np.array([6.5e4, 1.3e5, 2.6e5, 5.2e5, 1.05e6, 2.1e6])
    n = np.full(tokens.shape, 6000)
    true = a - b * tokens ** (-c)
    acc = rng.binomial(n, true) / n
    fit = fit_saturating(tokens, acc, n, n_boot=300, seed=0)
    assert fit["a_lo"] <= a <= fit["a_hi"], fit
    assert abs(fit["a"] - a) < 0.04, fit
    assert fit["a_lo"] > acc[-1] - 0.02  # the lower end says what the curve has nearly reached
    assert fit["identified"]
    # a curve still straight on a log axis (no bend in the data) fits any far-off asymptote: not identified
    straight = np.clip(0.1 + 0.03 * np.log(tokens / tokens[0]), 0, 1)
    loglinear = fit_saturating(tokens, rng.binomial(n, straight) / n, n, n_boot=300, seed=0)
    assert not loglinear["identified"], loglinear
    # a flat curve's asymptote is its level
    flat = fit_saturating(tokens, np.full(tokens.shape, 0.3), n, n_boot=100, seed=0)
    assert flat["a"] == pytest.approx(0.3, abs=0.02)


def test_gap_trend_has_the_sign_of_a_known_slope():
    tokens = np.array([1e5, 2e5, 4e5, 8e5, 1.6e6])
    grow = gap_trend(tokens, 0.01 + 0.02 * np.log10(tokens / 1e5), np.full(5, 0.002))
    hold = gap_trend(tokens, np.full(5, 0.03), np.full(5, 0.01))
    shrink = gap_trend(tokens, 0.1 - 0.03 * np.log10(tokens / 1e5), np.full(5, 0.002))
    assert (grow["trend"], hold["trend"], shrink["trend"]) == ("grows", "holds", "shrinks")
    assert grow["slope_lo"] > 0 and shrink["slope_hi"] < 0 and hold["slope_lo"] < 0 < hold["slope_hi"]


def test_training_to_a_plateau_ends_the_stable_phase_there_and_resumes_exactly(
    tiny_llama, stores, tmp_path, monkeypatch
):
    """A random tiny target gives held-out acc_0 that stops moving at once: the stable phase ends at the first
    evaluation where the last quarter moved it by less than the tolerance (a cap of 400 steps is never reached),
    the run ends after that point's WSD decay, and a run killed during the decay resumes to the same end."""
    c = cfg(train_steps=400, eval_every=5, plateau_stop=0.02, save_every=5)
    run = train_drafter(tiny_llama, *stores, c, tmp_path / "p", progress=False)
    evals = [e for e in run.logs["eval"]]
    decay_from = plateau_step(evals, 0.02)
    assert decay_from is not None and decay_from < 400
    want = decay_from + max(1, round(0.1 * decay_from))
    lrs = [r["lr"] for r in run.logs["history"]]
    assert len(lrs) == want  # stopped by the rule, not the cap
    assert lrs[2:decay_from] == [c.lr] * (decay_from - 2)  # stable (after 2 warmup steps)
    assert lrs[-1] == pytest.approx(c.lr * c.min_lr_ratio)  # annealed at the end
    assert "plateau" in run.drafter.cfg.extra["stop_reason"]
    # a run that saved its state mid-decay and was killed: the resumed call ends exactly as the uninterrupted one
    killed, real = tmp_path / "k", StoreBatches.batch

    def batch(self, step):  # killed when it asks for the batch of step want - 2 (state saved every 5 steps)
        if step == want - 2:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(StoreBatches, "batch", batch)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_llama, *stores, c, killed, progress=False)
    monkeypatch.setattr(StoreBatches, "batch", real)
    resumed = train_drafter(tiny_llama, *stores, c, killed, progress=False)
    assert [r["loss"] for r in resumed.logs["history"]] == [r["loss"] for r in run.logs["history"]]


def test_learning_curve_caption_counts_budgets_per_drafter_not_across_drafters():
    import pandas as pd

    from kvshot_lib.plots import FIGURES

    # a short row (plateaued early: 2 budgets) beside a long one (3 budgets at other token counts): 5 distinct
    # token counts in all, but no drafter has more than 3
    rows = [("none-ttt", n) for n in (100, 200)] + [("hidden-ttt", n) for n in (150, 300, 600)]
    t = {"learning_curves.csv": pd.DataFrame(rows, columns=["drafter", "tokens"])}
    assert FIGURES["02_learning_curves"].counts(t).startswith("2–3 budgets per drafter")
    t["learning_curves.csv"] = t["learning_curves.csv"][t["learning_curves.csv"]["drafter"] == "hidden-ttt"]
    assert FIGURES["02_learning_curves"].counts(t).startswith("3 budgets per drafter")


def test_budget_note_gives_the_budgets_of_the_drafters_a_figure_shows(tmp_path):
    import pandas as pd

    from kvshot_lib.training import budget_note

    # a run whose rows trained 1.7M and 8M token-passes on two machines; notebook 04 shows only kv-ttt
    pd.DataFrame(
        [
            ("none-ttt", 1_698_270, "bf16", "AMD EPYC", "avx512_bf16", 1_060_475),
            ("kv-ttt", 8_001_746, "bf16", "AMD EPYC", "avx512_bf16", 1_060_475),
            ("kv-ttt-zeroed", 1_700_000, "fp32", "AMD EPYC", "none", 1_060_475),
        ],
        columns=["drafter", "train_tokens", "precision", "cpu", "bf16_isa", "unique_tokens"],
    ).to_csv(tmp_path / "training_times.csv", index=False)
    whole = budget_note(tmp_path)
    assert whole.startswith("1.70M–8.00M token-passes per drafter over 1.06M unique tokens")
    assert "fp32 on AMD EPYC (none)" in whole
    shown = budget_note(tmp_path, ["kv-ttt"])
    assert shown.startswith("8.00M token-passes per drafter over 1.06M unique tokens")
    assert shown.endswith("trained in bf16 on AMD EPYC (avx512_bf16)")
    assert budget_note(tmp_path, {"hybrid-ttt": None}) == whole  # names the table lacks: every row
    # another run's committed checkpoints beside this run's drafters: their budget is not this run's
    beside = budget_note(tmp_path, ["kv-ttt", "kv-ttt@reference", "hidden-ttt@reference", "ngram"])
    assert beside == shown + "; <row>@reference: the reference run's committed checkpoints, trained there"
    only = budget_note(tmp_path, ["ngram", "hidden-ttt@reference"])  # none of this run's drafters is shown
    assert only == "<row>@reference: the reference run's committed checkpoints, trained there"


def test_two_drafters_of_one_paradigm_and_regime_are_told_apart_in_the_curves():
    import matplotlib.pyplot as plt
    import pandas as pd

    from kvshot_lib.plots import drafter_color, training

    # kv-ttt-tinit is kv-ttt with another initialization: the same paradigm, regime and KV condition
    rows = [
        (name, "kv", "ttt", kv, n, "acc_0", v, v - 0.01, v + 0.01)
        for name, kv in (("kv-ttt", "real"), ("kv-ttt-zeroed", "zeroed"), ("kv-ttt-tinit", "real"))
        for n, v in ((1e5, 0.2), (1e6, 0.3))
    ]
    cols = ["drafter", "paradigm", "regime", "target_kv", "tokens", "metric", "value", "lo", "hi"]
    fig = training.plot_learning_curves(pd.DataFrame(rows, columns=cols))
    color = {c.get_label(): c.lines[0].get_color() for c in fig.axes[0].containers}  # one per errorbar
    plt.close(fig)
    kv = tuple(drafter_color("kv-ttt", "kv"))
    assert tuple(color["kv-ttt"][:3]) == kv
    assert tuple(color["kv-ttt-zeroed"][:3]) == kv  # the zeroed control: faded, not recoloured
    assert tuple(color["kv-ttt-tinit"][:3]) == tuple(0.6 * c for c in kv)  # the second look-alike: darker


def test_look_alikes_alternate_darker_and_lighter_and_never_turn_black():
    from kvshot_lib.plots import shade_lookalikes

    looks = shade_lookalikes({f"d{i}": dict(color=(0.5, 0.25, 1.0)) for i in range(5)})
    got = [tuple(round(c, 6) for c in kw["color"]) for kw in looks.values()]
    assert got == [
        (0.5, 0.25, 1.0),
        (0.3, 0.15, 0.6),  # 0.6 of the colour
        (0.7, 0.55, 1.0),  # 0.6 of the way from white: 1 - 0.6 * (1 - c)
        (0.18, 0.09, 0.36),  # 0.36 of the colour
        (0.82, 0.73, 1.0),  # 0.36 of the way from white
    ]


def test_the_convergence_rule_ends_the_stable_phase_at_an_annealed_branch(tiny_llama, stores, tmp_path):
    """With a threshold no gain can pass, the rule fires at the first branch that has a point a doubling back;
    the run then ends after that budget's WSD decay. A run continued from it starts its curve at
    ``tokens_before`` with the starting drafter's own evaluation."""
    from kvshot_lib.training import converged_budget

    c = cfg(train_steps=80, curve_points=3, converge_z=1e9)  # budgets 20, 40, 80
    run = train_drafter(tiny_llama, *stores, c, tmp_path / "a", progress=False)
    budget = converged_budget(run.logs["curve"], 1e9)
    assert budget == 40  # 20 has nothing a doubling back
    assert len(run.logs["history"]) == 40 + 4  # its decay: 10% of 40 steps, not the cap of 80
    assert run.drafter.cfg.extra["stop_reason"].startswith("converged")
    more = cfg(train_steps=40, curve_points=2, init_from=str(tmp_path / "a"), tokens_before=123_456)
    cont = train_drafter(tiny_llama, *stores, more, tmp_path / "b", progress=False)
    first = cont.logs["curve"][0]
    assert (first["budget_step"], first["tokens"]) == (0, 123_456)
    assert first["acc_0"] == run.logs["eval"][-1]["acc_0"]  # the starting drafter is the finished run's
    assert [p["tokens"] > 123_456 for p in cont.logs["curve"][1:]] == [True, True]
