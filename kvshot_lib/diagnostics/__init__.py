"""The diagnostics stage: why KV-reading drafters do (not) work, measured on the real target. Where each is:

* query-estimation error (notebook 04), the drafter's attention queries against the target's real post-RoPE
  queries at the same (layer, head, position) on MT-bench text the target wrote: ``drafter_hooks`` (which
  target head a drafter head stands for; hooks that record or replace its queries), ``query_error`` (one
  sequence, scored by :class:`~.query_error.Scorer`), ``attention_metrics``, ``query_tables`` (the saved
  tables, the verdict against the stale query) and ``causal_check`` (α_k with queries moved to the truth);
* hidden-vs-KV information probes (notebook 01), equal-size probes reading the hidden state or the KV cache
  at ``t`` out through the frozen LM head, for the target's token at ``t+1+k``: ``probe_data`` (what the
  target holds), ``info_probes`` (the kinds, matched in size), ``probe_training`` and ``probe_stats``;
* ``memorization``: has a drafter memorized its training answers (seen against unseen conversations)?
* ``mtbench_gap``: why MT-bench acceptance sits below held-out accuracy (answer position, prompts, cycle starts);
* ``explorers``: interactive explorers (ipywidgets) for attention and acceptance.

It reads drafters, the target and the evaluation harness (its bootstrap included: ``mean_ci`` and ``ratio_ci``
are :mod:`kvshot_lib.evaluation.bootstrap`'s), and hands result tables to the plots.
"""

from ..evaluation.bootstrap import mean_ci, ratio_ci
from . import attention_metrics, explorers, info_probes, probe_stats
from .attention_metrics import METRICS, all_metrics
from .causal_check import (
    causal_alpha,
    causal_summary,
    mixing_hook,
    run_causal_check,
    sequence_id,
    substitutes,
)
from .drafter_hooks import TargetAttentionRecorder, drafter_queries, head_map, query_in_key_space
from .explorers import AcceptanceExplorer, AttentionExplorer, has_widget_frontend, show
from .info_probes import KINDS, ProbeBank, ProbeDims, Readout, probe_widths
from .memorization import paired_difference, per_sequence, seen_unseen_gap
from .mtbench_gap import (
    answer_positions,
    binned_accuracy,
    cycle_start_positions,
    gap_table,
    outcome_rows,
    reference_split,
)
from .probe_data import ProbeData, ProbeDoc, probe_documents
from .probe_stats import information_gap, pairwise_tests, probe_results, slope
from .probe_training import (
    ProbeConfig,
    ProbeRun,
    batches_of,
    label_index,
    readout_vocab,
    run_probes,
    train_probes,
)
from .query_error import ESTIMATORS, SequenceErrors, measure_sequence, sequence_batch, target_pass
from .query_tables import (
    QueryErrorTables,
    figure_tables,
    kv_reading_drafters,
    measure_drafters,
    stale_verdict,
)

__all__ = [
    "answer_positions",
    "binned_accuracy",
    "cycle_start_positions",
    "gap_table",
    "outcome_rows",
    "reference_split",
    "paired_difference",
    "per_sequence",
    "seen_unseen_gap",
    "AcceptanceExplorer",
    "AttentionExplorer",
    "ESTIMATORS",
    "KINDS",
    "METRICS",
    "ProbeBank",
    "ProbeConfig",
    "ProbeData",
    "ProbeDims",
    "ProbeDoc",
    "ProbeRun",
    "QueryErrorTables",
    "Readout",
    "SequenceErrors",
    "TargetAttentionRecorder",
    "all_metrics",
    "attention_metrics",
    "batches_of",
    "causal_alpha",
    "causal_summary",
    "drafter_queries",
    "explorers",
    "figure_tables",
    "has_widget_frontend",
    "head_map",
    "info_probes",
    "information_gap",
    "kv_reading_drafters",
    "label_index",
    "mean_ci",
    "measure_drafters",
    "measure_sequence",
    "mixing_hook",
    "pairwise_tests",
    "probe_documents",
    "probe_results",
    "probe_stats",
    "probe_widths",
    "query_in_key_space",
    "ratio_ci",
    "readout_vocab",
    "run_causal_check",
    "run_probes",
    "sequence_batch",
    "sequence_id",
    "show",
    "slope",
    "stale_verdict",
    "substitutes",
    "target_pass",
    "train_probes",
]
