"""The registry of every figure of the suite: its name, the notebook that writes its tables, the tables and
columns it reads, the function that draws it and the counts its caption line gives (:mod:`.counts`).

:data:`FIGURES` is the list of what ``kvshot figures`` can redraw; :mod:`.figures` reads, draws, publishes and
redraws them. Adding a figure is one :class:`FigureSpec` here, drawn by a function of its notebook family's
module (:mod:`.corpus`, :mod:`.training`, :mod:`.decoding`, :mod:`.diagnostics`, :mod:`.specpv`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import acceptance, corpus, decoding, diagnostics, gap, probes, specpv, training
from .counts import (
    acceptance_counts,
    cost_counts,
    curve_counts,
    gap_counts,
    memorization_counts,
    n_range,
    per_step_counts,
    probe_counts,
    sequences,
    specpv_counts,
    speed_machine,
    speedup_counts,
    stopped_rows,
)


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


CURVE_COLUMNS = ["drafter", "paradigm", "regime", "tokens", "metric", "value", "lo", "hi"]


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
        probe_counts,
    ),
    FigureSpec(
        "01_information_gap",
        "01_information_probes",
        ("information_gap.csv", "probe_results.csv"),
        lambda t: diagnostics.plot_information_gap(t["information_gap.csv"]),
        {"information_gap.csv": ["kv_probe", "step", "gap_bits", "ci_lo", "ci_hi", "verdict"]},
        probe_counts,
    ),
    FigureSpec(
        "02_per_step_accuracy",
        "02_train_drafters",
        ("per_step_accuracy.csv",),
        lambda t: training.plot_per_step_accuracy(t["per_step_accuracy.csv"]),
        {"per_step_accuracy.csv": ["drafter", "paradigm", "regime", "draft_step", "accuracy", "n"]},
        per_step_counts,
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
            f"ours: {n_range(t['per_step_accuracy.csv']['n'])} held-out positions a point, band: 95% Wilson "
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
            f"each point: {n_range(t['kv_ablation.csv']['n'])} held-out positions; band: 95% Wilson interval"
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
            f"each point: {n_range(t['heldout_cross.csv']['n'])} held-out positions; band: 95% Wilson interval"
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
            t["learning_curves.csv"], t["curve_asymptotes.csv"], stopped_rows(t)
        ),
        {
            "learning_curves.csv": CURVE_COLUMNS,
            "curve_asymptotes.csv": ["drafter", "metric", "a", "a_lo", "a_hi", "identified"],
            "stopped_curves.csv": [*CURVE_COLUMNS, "saved_step", "train_steps"],
        },
        curve_counts,
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
        lambda t: f"each point: {n_range(t['heldout_eval.csv']['n_0'])} held-out positions at step 0",
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
        acceptance_counts,
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
        lambda t: f"each bar: {n_range(t['acceptance_summary.csv']['n_cycles'])} verification cycles",
        optional=("acceptance_bootstrap.csv",),
    ),
    FigureSpec(
        "04_query_error_by_step",
        "04_query_estimation_error",
        ("query_error_by_sequence.csv",),
        lambda t: diagnostics.plot_query_error_by_step(t["query_error_by_sequence.csv"]),
        {"query_error_by_sequence.csv": [*QUERY_ERROR_COLUMNS, "sequence", "kl_bits", "unavailable_mass"]},
        sequences("query_error_by_sequence.csv"),
    ),
    FigureSpec(
        "04_query_error_by_head",
        "04_query_estimation_error",
        ("query_error_by_head.csv",),
        lambda t: diagnostics.plot_query_error_by_head(t["query_error_by_head.csv"]),
        {"query_error_by_head.csv": [*QUERY_ERROR_COLUMNS, "level", "layer", "head", "matched", "n"]},
        lambda t: (
            f"each point: mean over {n_range(t['query_error_by_head.csv']['n'])} anchors per step, steps averaged"
        ),
    ),
    FigureSpec(
        "04_query_error_vs_acceptance",
        "04_query_estimation_error",
        ("query_error_accepted.csv",),
        lambda t: diagnostics.plot_query_error_vs_acceptance(t["query_error_accepted.csv"]),
        {"query_error_accepted.csv": [*QUERY_ERROR_COLUMNS, "sequence", "accepted"]},
        sequences("query_error_accepted.csv"),
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
            f"each point: {n_range(t['query_causal_check.csv']['n_attempts'][t['query_causal_check.csv']['n_attempts'] >= 20])} "
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
        lambda t: f"each point: {n_range(t['remedy_per_step_accuracy.csv']['n'])} held-out positions",
    ),
    FigureSpec(
        "06_speedup_vs_mat",
        "06_end_to_end_speedup",
        ("speedup.csv",),
        lambda t: decoding.plot_speedup_vs_mat(t["speedup.csv"]),
        {"speedup.csv": ["method", "drafter", "temperature", "speedup_vs_ar", "mat"]},
        speedup_counts,
    ),
    FigureSpec(
        "06_cost_model",
        "06_end_to_end_speedup",
        ("cost_models.csv",),
        lambda t: decoding.plot_cost_model(t["cost_models.csv"]),
        {"cost_models.csv": ["precision", "part", "drafter", "n", "seconds"]},
        cost_counts,
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
        specpv_counts,
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
        speed_machine,
    ),
    FigureSpec(
        "07_specpv_phases",
        "07_specpv_long_context",
        ("specpv_speed.csv",),
        lambda t: specpv.plot_phases(t["specpv_speed.csv"]),
        {"specpv_speed.csv": ["context", "method", "tokens_per_s", *(c for c, _ in specpv.PHASES)]},
        speed_machine,
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
        gap_counts,
        command="python scripts/reference/mtbench_gap.py",
    ),
    FigureSpec(
        "04_memorization_gap",
        "04_query_estimation_error",
        ("memorization_gap.csv",),
        lambda t: gap.plot_memorization_gap(t["memorization_gap.csv"], t.get("memorization_paired.csv")),
        {"memorization_gap.csv": ["drafter", "unseen_set", "measure", "k", "gap", "lo", "hi"]},
        memorization_counts,
        optional=("memorization_paired.csv",),
        command="python scripts/reference/memorization_gap.py",
    ),
]
FIGURES = {s.name: s for s in SPECS}
