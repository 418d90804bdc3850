"""The registry of every figure of the suite: its name, the notebook that writes its tables, the tables and
columns it reads, the function that draws it and the counts its caption line gives.

:data:`FIGURES` is the list of what ``kvshot figures`` can redraw; :mod:`.figures` reads, draws, publishes and
redraws them. Adding a figure is one :class:`FigureSpec` here, drawn by a function of its notebook family's
module (:mod:`.corpus`, :mod:`.training`, :mod:`.decoding`, :mod:`.diagnostics`, :mod:`.specpv`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import acceptance, corpus, decoding, diagnostics, gap, probes, specpv, training


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem, e.g. "02_per_step_accuracy" (the number is the notebook's)
    notebook: str  # the notebook that writes the tables
    tables: tuple[str, ...]  # file names under results/ (CSV, or JSON for nested data)
    draw: Callable[[dict], object]  # tables -> matplotlib figure
    columns: dict  # table -> columns the drawing needs
    counts: Callable[[dict], str] = lambda t: ""  # tables -> "what each point averages"
    optional: tuple[str, ...] = ()  # tables read (and kept beside the figure) where they are present
    command: str = ""  # what writes the tables where no notebook does (a step of the reference run)
    only_with: str = ""  # a table without which a folder has no such figure (the paper's Table 5)

    @property
    def writer(self) -> str:
        """What writes the figure's tables, for error messages: the command, else the notebook."""
        return f"`{self.command}`" if self.command else f"notebook {self.notebook}"

    @property
    def rerun(self) -> str:
        """How to write the tables again."""
        return self.command or f"kvshot run --only {self.notebook[:2]}"


def _n_range(values) -> str:
    if not len(values):  # e.g. no step reached the attempts a point needs
        return "0"
    lo, hi = int(min(values)), int(max(values))
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def _per_step_counts(t):
    n = t["per_step_accuracy.csv"]["n"]
    return f"each point: {_n_range(n)} held-out positions; band: 95% Wilson interval"


def _acceptance_counts(t):
    d = t["acceptance_by_step.csv"]
    d = d[d["mode"] == ("chain" if (d["mode"] == "chain").any() else d["mode"].iloc[0])]
    shown = d["n_attempts"][d["n_attempts"] >= acceptance.REACH_MIN]
    turns = t.get("acceptance_bootstrap.csv")
    over = (
        f" over {_n_range(turns['n_generations'])} turns"
        if turns is not None and "n_generations" in turns
        else ""
    )
    return f"each point: {_n_range(shown)} draft attempts{over}; {acceptance.caption()}"


def _speedup_counts(t):
    d = t["speedup.csv"]
    prompts = f"{int(d['n_prompts'].max())} prompts" if "n_prompts" in d else "MT-bench prompts"
    machine = d["machine"].iloc[0] if "machine" in d and len(d) else "this machine"
    reps = int(d["n_reps"].max()) if "n_reps" in d else 1
    if reps > 1:
        return f"each point: {prompts}, median of {reps} interleaved repetitions on {machine} (bars: min-max)"
    return f"each point: {prompts}, one run on {machine}"


CURVE_COLUMNS = ["drafter", "paradigm", "regime", "tokens", "metric", "value", "lo", "hi"]


def _stopped_rows(t):
    """The points of the rows whose training stopped short (``stopped_curves.csv``, where present), less any row
    that has since finished (is in ``learning_curves.csv``)."""
    stopped = t.get("stopped_curves.csv")
    return None if stopped is None else stopped[~stopped["drafter"].isin(t["learning_curves.csv"]["drafter"])]


def _curve_counts(t):
    counts = (
        f"{_n_range(t['learning_curves.csv'].groupby('drafter')['tokens'].nunique())} budgets per drafter, "
        "each after a WSD decay branch "
        "(warmup-stable-decay; the last point is the run's own decay); bars: 95% intervals (Wilson; MAT: "
        "parametric bootstrap)"
    )
    stopped = _stopped_rows(t)
    if stopped is None:
        return counts
    last = stopped.sort_values("tokens").groupby("drafter").last()
    return f"{counts}; stopped: " + ", ".join(
        f"{name} at step {int(r['saved_step']):,} of {int(r['train_steps']):,} "
        f"(last point {r['tokens'] / 1e6:.1f}M token-passes)"
        for name, r in last.iterrows()
    )


def _specpv_counts(t):
    n = t["specpv_fidelity_runs.csv"].groupby(["context", "budget", "full_every", "mode"]).size().max()
    return (
        f"each point: {n} prompts; band: 95% bootstrap interval"
        if n > 1
        else "each point: one prompt (no interval)"
    )


def _speed_machine(t, name="specpv_speed.csv"):
    d = t[name]
    return f"{int(d['n_prompts'].max())} prompts per context, one run on {d['machine'].iloc[0]}"


def _sequences(table: str, what: str = "sequences"):
    return lambda t: (
        f"{t[table]['sequence'].nunique()} MT-bench {what} (target-greedy answers); band: 95% bootstrap over them"
    )


def _probe_counts(t):
    d = t["probe_results.csv"]
    d = d[d["metric"] == "top1"]
    return (
        f"each point: {_n_range(d['n_examples'])} test examples from {int(d['n_docs'].max())} held-out "
        f"ShareGPT documents, {int(d['n_seeds'].max())} seeds; band: 95% bootstrap over documents"
    )


def _gap_counts(t):
    g = t["mtbench_gap.csv"]
    n = int(g.loc[g["name"] == "mtbench_tf", "n"].max())
    return (
        "parts: held-out whole answers vs their first 64 tokens; held-out vs MT-bench prompts "
        f"({n:,} MT-bench positions); every token vs the tokens after a miss (cycle starts); teacher forcing at "
        "those vs chain decoding. Bars: 95% bootstrap over conversations and turns; lines: step 0, held-out solid, "
        "MT-bench dashed"
    )


def _memorization_counts(t):
    g = t["memorization_gap.csv"]
    return (
        f"{_n_range(g['conversations_seen'])} seen and {_n_range(g['conversations_unseen'])} unseen conversations "
        "a drafter; bars: 95% bootstrap over conversations, each set resampled on its own (paired: the same "
        "conversations for both drafters)"
    )


QUERY_ERROR_COLUMNS = ["drafter", "paradigm", "estimator", "variant", "step", "out_err"]

SPECS = [
    FigureSpec(
        "00_length_distributions",
        "00_target_and_data",
        ("sharegpt_conversations.csv", "sharegpt_responses.csv", "target_info.json"),
        lambda t: corpus.plot_length_distributions(
            t["sharegpt_conversations.csv"], t["sharegpt_responses.csv"], t["target_info.json"]["max_context"]
        ),
        {"sharegpt_conversations.csv": ["tokens"], "sharegpt_responses.csv": ["tokens"]},
        lambda t: (
            f"{len(t['sharegpt_conversations.csv'])} conversations, {len(t['sharegpt_responses.csv'])} responses"
        ),
    ),
    FigureSpec(
        "01_probe_results_by_k",
        "01_information_probes",
        ("probe_results.csv",),
        lambda t: diagnostics.plot_probe_results(t["probe_results.csv"]),
        {"probe_results.csv": ["kind", "task", "step", "metric", "value", "ci_lo", "ci_hi", "n_examples"]},
        _probe_counts,
    ),
    FigureSpec(
        "01_information_gap",
        "01_information_probes",
        ("information_gap.csv", "probe_results.csv"),
        lambda t: diagnostics.plot_information_gap(t["information_gap.csv"]),
        {"information_gap.csv": ["kv_probe", "step", "gap_bits", "ci_lo", "ci_hi", "verdict"]},
        _probe_counts,
    ),
    FigureSpec(
        "02_per_step_accuracy",
        "02_train_drafters",
        ("per_step_accuracy.csv",),
        lambda t: training.plot_per_step_accuracy(t["per_step_accuracy.csv"]),
        {"per_step_accuracy.csv": ["drafter", "paradigm", "regime", "draft_step", "accuracy", "n"]},
        _per_step_counts,
    ),
    FigureSpec(
        "02_paper_table5",
        "02_train_drafters",
        ("per_step_accuracy.csv", "paper_table5.csv"),
        lambda t: acceptance.plot_paper_table5(t["per_step_accuracy.csv"], t["paper_table5.csv"]),
        {
            "per_step_accuracy.csv": ["drafter", "paradigm", "draft_step", "accuracy", "n"],
            "paper_table5.csv": ["paper_row", *(f"alpha_{k}" for k in range(7))],
        },
        lambda t: (
            f"ours: {_n_range(t['per_step_accuracy.csv']['n'])} held-out positions a point, band: 95% Wilson "
            "interval; paper: Qwen3-8B, ShareGPT ~70k samples × 3 epochs, SpecForge TTT (its Table 5, no interval)"
        ),
        command="python -m kvshot_lib.reference",
        only_with="paper_table5.csv",
    ),
    FigureSpec(
        "02_kv_ablation",
        "02_train_drafters",
        ("kv_ablation.csv",),
        lambda t: training.plot_kv_ablation(t["kv_ablation.csv"]),
        {
            "kv_ablation.csv": [
                "drafter",
                "paradigm",
                "regime",
                "trained_with",
                "condition",
                "draft_step",
                "accuracy",
                "n",
            ]
        },
        lambda t: (
            f"each point: {_n_range(t['kv_ablation.csv']['n'])} held-out positions; band: 95% Wilson interval"
        ),
    ),
    FigureSpec(
        "02_heldout_cross",
        "02_train_drafters",
        ("heldout_cross.csv",),
        lambda t: training.plot_heldout_cross(t["heldout_cross.csv"]),
        {
            "heldout_cross.csv": [
                "drafter",
                "paradigm",
                "heldout",
                "trained_on",
                "token_passes",
                "draft_step",
                "accuracy",
                "n",
                "ceiling",
            ]
        },  # fmt: skip
        lambda t: (
            f"each point: {_n_range(t['heldout_cross.csv']['n'])} held-out positions; band: 95% Wilson interval"
        ),
        command="python -m kvshot_lib.reference --profile onpolicy --steps heldout",
    ),
    FigureSpec(
        "02_training_curves",
        "02_train_drafters",
        ("training_history.csv",),
        lambda t: training.plot_training_curves(t["training_history.csv"]),
        {"training_history.csv": ["drafter", "paradigm", "regime", "step", "loss", "acc_0"]},
        lambda t: (
            f"rolling mean of 10 optimizer steps; {int(t['training_history.csv']['tokens'].sum()):,} training tokens in all"
        ),
    ),
    FigureSpec(
        "02_learning_curves",
        "02_train_drafters",
        ("learning_curves.csv", "curve_asymptotes.csv"),
        lambda t: training.plot_learning_curves(
            t["learning_curves.csv"], t["curve_asymptotes.csv"], _stopped_rows(t)
        ),
        {
            "learning_curves.csv": CURVE_COLUMNS,
            "curve_asymptotes.csv": ["drafter", "metric", "a", "a_lo", "a_hi", "identified"],
            "stopped_curves.csv": [*CURVE_COLUMNS, "saved_step", "train_steps"],
        },
        _curve_counts,
        # the rows whose training stopped short (the reference run's block-kv), where their points were tabled
        # (scripts/reference/partial_curve_points.py --stopped)
        optional=("stopped_curves.csv",),
    ),
    FigureSpec(
        "02_heldout_over_training",
        "02_train_drafters",
        ("heldout_eval.csv",),
        lambda t: training.plot_heldout_over_training(t["heldout_eval.csv"]),
        {"heldout_eval.csv": ["drafter", "paradigm", "regime", "step", "acc_0"]},
        lambda t: f"each point: {_n_range(t['heldout_eval.csv']['n_0'])} held-out positions at step 0",
    ),
    FigureSpec(
        "03_acceptance_by_step",
        "03_acceptance_by_step",
        ("acceptance_by_step.csv",),
        lambda t: acceptance.plot_acceptance_by_step(
            t["acceptance_by_step.csv"], t.get("acceptance_bootstrap.csv")
        ),
        {
            "acceptance_by_step.csv": [
                "drafter",
                "mode",
                "temperature",
                "step",
                "alpha_conditional",
                "p_reach",
                "n_attempts",
            ],
            "acceptance_bootstrap.csv": ["drafter", "mode", "temperature", "metric", "lo", "hi"],
        },
        _acceptance_counts,
        optional=("acceptance_bootstrap.csv",),
    ),
    FigureSpec(
        "03_mat_by_drafter",
        "03_acceptance_by_step",
        ("acceptance_summary.csv",),
        lambda t: decoding.plot_mat_by_drafter(
            t["acceptance_summary.csv"], t.get("acceptance_bootstrap.csv")
        ),
        {
            "acceptance_summary.csv": ["drafter", "mode", "temperature", "mat"],
            "acceptance_bootstrap.csv": ["drafter", "mode", "temperature", "metric", "lo", "hi"],
        },
        lambda t: f"each bar: {_n_range(t['acceptance_summary.csv']['n_cycles'])} verification cycles",
        optional=("acceptance_bootstrap.csv",),
    ),
    FigureSpec(
        "04_query_error_by_step",
        "04_query_estimation_error",
        ("query_error_by_sequence.csv",),
        lambda t: diagnostics.plot_query_error_by_step(t["query_error_by_sequence.csv"]),
        {"query_error_by_sequence.csv": [*QUERY_ERROR_COLUMNS, "sequence", "kl_bits", "unavailable_mass"]},
        _sequences("query_error_by_sequence.csv"),
    ),
    FigureSpec(
        "04_query_error_by_head",
        "04_query_estimation_error",
        ("query_error_by_head.csv",),
        lambda t: diagnostics.plot_query_error_by_head(t["query_error_by_head.csv"]),
        {"query_error_by_head.csv": [*QUERY_ERROR_COLUMNS, "level", "layer", "head", "matched", "n"]},
        lambda t: (
            f"each point: mean over {_n_range(t['query_error_by_head.csv']['n'])} anchors per step, steps averaged"
        ),
    ),
    FigureSpec(
        "04_query_error_vs_acceptance",
        "04_query_estimation_error",
        ("query_error_accepted.csv",),
        lambda t: diagnostics.plot_query_error_vs_acceptance(t["query_error_accepted.csv"]),
        {"query_error_accepted.csv": [*QUERY_ERROR_COLUMNS, "sequence", "accepted"]},
        _sequences("query_error_accepted.csv"),
    ),
    FigureSpec(
        "04_query_causal_check",
        "04_query_estimation_error",
        ("query_causal_check.csv",),
        lambda t: diagnostics.plot_causal_check(t["query_causal_check.csv"]),
        {
            "query_causal_check.csv": [
                "drafter",
                "lam",
                "step",
                "alpha_conditional",
                "ci_lo",
                "ci_hi",
                "n_attempts",
                "mat",
            ]
        },
        lambda t: (
            f"each point: {_n_range(t['query_causal_check.csv']['n_attempts'][t['query_causal_check.csv']['n_attempts'] >= 20])} "
            "draft attempts; bars: 95% bootstrap over MT-bench turns; steps with < 20 attempts hidden"
        ),
    ),
    FigureSpec(
        "05_grad_group_stats",
        "02_train_drafters",
        ("grad_probes.csv",),
        lambda t: probes.plot_grad_group_stats(t["grad_probes.csv"]),
        {"grad_probes.csv": ["drafter", "paradigm", "regime", "step", "group", "rms", "frac_small", "hoyer"]},
        lambda t: "each point: one probed optimizer step (one training batch)",
    ),
    FigureSpec(
        "05_kv_vs_other_groups",
        "02_train_drafters",
        ("grad_probes.csv",),
        lambda t: probes.plot_kv_vs_other_groups(t["grad_probes.csv"]),
        {"grad_probes.csv": ["drafter", "group", "rms"]},
        lambda t: f"each bar: median over {t['grad_probes.csv']['step'].nunique()} probed steps",
    ),
    FigureSpec(
        "05_kv_position_gradients",
        "02_train_drafters",
        ("kv_position_samples.csv", "kv_positions.csv"),
        lambda t: probes.plot_kv_position_gradients(t["kv_position_samples.csv"], t["kv_positions.csv"]),
        {
            "kv_position_samples.csv": [
                "drafter",
                "paradigm",
                "regime",
                "layer",
                "own_step",
                "received",
                "grad_k",
            ]
        },
        lambda t: "each dot: one of the drafter's own K/V positions at the last probe",
    ),
    FigureSpec(
        "05_attention_mass",
        "02_train_drafters",
        ("attention_mass.csv",),
        lambda t: probes.plot_attention_mass(t["attention_mass.csv"]),
        {"attention_mass.csv": ["drafter", "step", "layer", "segment", "share", "sink_share"]},
        lambda t: "each bar: mean over the positions of the last probed batch",
    ),
    FigureSpec(
        "05_remedies",
        "05_kv_gradient_sparsity",
        ("remedy_per_step_accuracy.csv", "remedy_grad_probes.csv"),
        lambda t: probes.plot_remedies(t["remedy_per_step_accuracy.csv"], t["remedy_grad_probes.csv"]),
        {"remedy_per_step_accuracy.csv": ["drafter", "draft_step", "accuracy"]},
        lambda t: f"each point: {_n_range(t['remedy_per_step_accuracy.csv']['n'])} held-out positions",
    ),
    FigureSpec(
        "06_speedup_vs_mat",
        "06_end_to_end_speedup",
        ("speedup.csv",),
        lambda t: decoding.plot_speedup_vs_mat(t["speedup.csv"]),
        {"speedup.csv": ["method", "drafter", "temperature", "speedup_vs_ar", "mat"]},
        _speedup_counts,
    ),
    FigureSpec(
        "06_cost_model",
        "06_end_to_end_speedup",
        ("cost_models.csv",),
        lambda t: decoding.plot_cost_model(t["cost_models.csv"]),
        {"cost_models.csv": ["precision", "part", "drafter", "n", "seconds"]},
        lambda t: (
            f"lower quartile of repeated timings; {t['cost_models.csv']['key'].iloc[0].split('|')[1]}"
            if "key" in t["cost_models.csv"]
            else "lower quartile of repeated timings"
        ),
    ),
    FigureSpec(
        "07_specpv_fidelity",
        "07_specpv_long_context",
        ("specpv_fidelity_runs.csv",),
        lambda t: specpv.plot_fidelity(t["specpv_fidelity_runs.csv"]),
        {
            "specpv_fidelity_runs.csv": [
                "context",
                "budget",
                "full_every",
                "mode",
                "exact_match",
                "top1_agreement",
                "rouge_l",
            ]
        },
        _specpv_counts,
    ),
    FigureSpec(
        "07_specpv_drift",
        "07_specpv_long_context",
        ("specpv_fidelity_steps.csv",),
        lambda t: specpv.plot_drift(t["specpv_fidelity_steps.csv"]),
        {"specpv_fidelity_steps.csv": ["budget", "mode", "distance", "cosine", "top1_agree"]},
        lambda t: (
            f"{len(t['specpv_fidelity_steps.csv']):,} partially verified rows, each against a shadow full verification"
        ),
    ),
    FigureSpec(
        "07_specpv_speed",
        "07_specpv_long_context",
        ("specpv_speed.csv",),
        lambda t: specpv.plot_speed(t["specpv_speed.csv"]),
        {"specpv_speed.csv": ["context", "method", "budget", "full_every", "tokens_per_s", "machine"]},
        _speed_machine,
    ),
    FigureSpec(
        "07_specpv_phases",
        "07_specpv_long_context",
        ("specpv_speed.csv",),
        lambda t: specpv.plot_phases(t["specpv_speed.csv"]),
        {"specpv_speed.csv": ["context", "method", "tokens_per_s", *(c for c, _ in specpv.PHASES)]},
        _speed_machine,
    ),
    FigureSpec(
        "07_specpv_cost_model",
        "07_specpv_long_context",
        ("specpv_cost_curves.csv", "specpv_crossover.csv", "specpv_speed.csv"),
        lambda t: specpv.plot_cost_model(
            t["specpv_cost_curves.csv"], t["specpv_crossover.csv"], t["specpv_speed.csv"]
        ),
        {
            "specpv_cost_curves.csv": ["machine", "budget", "full_every", "length", "ratio"],
            "specpv_crossover.csv": ["machine", "budget", "full_every", "crossover_tokens"],
        },
        lambda t: (
            "CPU: t(L, n) fitted to forwards timed in this run; H100: a memory-bound model (kvshot_lib.evaluation.specpv_cost)"
        ),
    ),
    FigureSpec(
        "04_mtbench_gap",
        "04_query_estimation_error",
        ("mtbench_gap.csv", "mtbench_gap_bins.csv"),
        lambda t: gap.plot_mtbench_gap(t["mtbench_gap.csv"], t["mtbench_gap_bins.csv"]),
        {
            "mtbench_gap.csv": ["drafter", "kind", "name", "value", "lo", "hi"],
            "mtbench_gap_bins.csv": ["drafter", "set", "by", "k", "bin", "accuracy"],
        },
        _gap_counts,
        command="python scripts/reference/mtbench_gap.py",
    ),
    FigureSpec(
        "04_memorization_gap",
        "04_query_estimation_error",
        ("memorization_gap.csv",),
        lambda t: gap.plot_memorization_gap(t["memorization_gap.csv"], t.get("memorization_paired.csv")),
        {"memorization_gap.csv": ["drafter", "unseen_set", "measure", "k", "gap", "lo", "hi"]},
        _memorization_counts,
        optional=("memorization_paired.csv",),
        command="python scripts/reference/memorization_gap.py",
    ),
]
FIGURES = {s.name: s for s in SPECS}
