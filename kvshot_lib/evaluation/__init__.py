"""The evaluation stage: acceptance by draft step and end-to-end speedup on MT-bench.

* :mod:`.metrics` defines α_k (conditional), the reach probability, MAT and retention once;
* :mod:`.acceptance` decodes MT-bench with every drafter (an exact greedy replay at temperature 0, the
  engine otherwise) and tabulates acceptance by step;
* :mod:`.speedup` times plain, speculative (fixed and chosen shapes, prompt lookup joined in) and Hugging Face
  decoding in one run on one machine, in float32 and bf16, repeated and interleaved; :mod:`.speed_table`
  summarizes it (median and range, phases, the MAT 1.5x needs) and finds where bf16 outputs diverge;
* SpecPV at long context: :mod:`.specpv_fidelity` (exact match, divergence, top-1 agreement, KL, hidden
  cosine by distance, ROUGE-L against lossless decoding), :mod:`.specpv_speed` (decode tokens/s, phase
  times, MAT by verification kind, in one run) and :mod:`.specpv_cost` (the fitted cost model, crossover);
* :mod:`.learning_curves`: held-out accuracy and MAT against training tokens, saturating fits with their
  asymptotes, and the gaps between paradigms by budget with their trends;
* :mod:`.bootstrap` gives 95% intervals of acceptance metrics by resampling generations.

It hands result tables (one row per drafter, mode, step or method) to the plots.
"""

from . import metrics, specpv_cost, specpv_fidelity, specpv_speed, speed_table
from .acceptance import (
    AcceptanceRun,
    Reference,
    acceptance_summary,
    acceptance_table,
    greedy_references,
    mode_configs,
    replay_greedy,
    run_engine,
    run_greedy_replay,
)
from .bootstrap import bootstrap_acceptance, generation_table, paired_mat_difference
from .learning_curves import (
    CURVE_METRICS,
    asymptotes,
    comparison_pairs,
    curve_table,
    fit_saturating,
    gap_by_budget,
    gap_trend,
    gap_trends,
)
from .specpv_fidelity import FidelityProbe, rouge_l, shadow_full
from .speed_table import cost_model_table, divergences, machine_info, machine_name, runs_table, speedup_table
from .speedup import (
    CHOSEN_METHODS,
    FIXED_METHODS,
    HF_METHODS,
    METHODS,
    Method,
    Setup,
    precision_setups,
    run_benchmark,
    run_mtbench_benchmark,
)

__all__ = [
    "CURVE_METRICS",
    "asymptotes",
    "comparison_pairs",
    "curve_table",
    "fit_saturating",
    "gap_by_budget",
    "gap_trend",
    "gap_trends",
    "AcceptanceRun",
    "CHOSEN_METHODS",
    "FIXED_METHODS",
    "FidelityProbe",
    "HF_METHODS",
    "METHODS",
    "Method",
    "Setup",
    "cost_model_table",
    "divergences",
    "precision_setups",
    "runs_table",
    "speed_table",
    "Reference",
    "acceptance_summary",
    "acceptance_table",
    "bootstrap_acceptance",
    "generation_table",
    "paired_mat_difference",
    "greedy_references",
    "machine_info",
    "machine_name",
    "metrics",
    "mode_configs",
    "replay_greedy",
    "rouge_l",
    "run_benchmark",
    "run_engine",
    "run_greedy_replay",
    "run_mtbench_benchmark",
    "shadow_full",
    "specpv_cost",
    "specpv_fidelity",
    "specpv_speed",
    "speedup_table",
]
