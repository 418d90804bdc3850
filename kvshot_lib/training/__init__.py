"""The training stage: turn feature stores (or tokenized splits) into a drafter checkpoint, with its logs.

* ``config.py``: :class:`TrainConfig` (:func:`parse_drafter_specs` for a notebook's list), the one place a
  parameter dict becomes a validated configuration;
* ``data.py``: what a run trains on (``data_source``): feature stores (``batches.py``) or tokenized splits,
  the target run inside the loop (``online.py``); ``init_from_checkpoint``;
* ``loop.py``: :func:`train_drafter`, one drafter's run, with ``accelerate``; ``resume.py``: where a run goes on
  from (its saved state, ``state.py``; between machines, a carried folder, ``carry.py``);
  ``losses.py``: the regimes' objectives (teacher forcing, TTT, ``ttt_dense``, ``parallel``);
* ``schedule.py``: the learning rate (cosine, warmup-stable-decay) and the learning-curve budgets;
  ``convergence.py``: when to stop (``Stopping``: plateau, early stopping, time cap) and run summaries;
* ``heldout.py``: per-step held-out accuracy; ``kv_ablation.py``: the same with the target KV ablated;
  ``grad_probes.py``: the gradient reaching each parameter group and K/V position;
* ``heldout.py`` also stacks finished runs' log tables, each row with the machine that ran its step
  (``stretches.py``: a carried run's stretches between restarts);
* ``cli.py``: ``kvshot train``.

It hands checkpoint folders (``config.json`` + ``model.safetensors``) and log tables to decoding,
evaluation and the plots.
"""

from .batches import BatchOrder, StoreBatches, batch_from_target, collate, target_sequence
from .carry import carried_ahead, read_carried, rewarm_factor, write_carried
from .config import DATA_SOURCES, TrainConfig, TrainConfigError, parse_drafter_specs
from .convergence import (
    EarlyStopping,
    annealed_plateau,
    converged_budget,
    convergence_table,
    heldout_acceptance,
    plateau,
    plateau_step,
    portable_init,
    run_summary,
    se_acc,
    se_ce,
    stable_plateau,
)
from .data import init_from_checkpoint
from .grad_probes import (
    GROUPS,
    PROBE_TABLES,
    GradProbe,
    grad_stats,
    grouped_parameters,
    kv_gradient_summary,
    load_probe_tables,
    param_group,
    spearman,
)
from .heldout import (
    BranchOutcome,
    EvalSet,
    branch_outcomes,
    budget_note,
    combined_table,
    evaluate_per_step,
    gate_summary,
    greedy_targets,
    machine_of,
    per_step_table,
    run_machine,
    run_stretches,
    training_times,
)
from .kv_ablation import KV_CONDITIONS, kv_ablation_table, with_target_kv, zero_target_kv
from .loop import (
    Objective,
    TrainResult,
    build_draft_vocab,
    build_optimizer,
    finished_config,
    finished_extra,
    make_accelerator,
    new_drafter,
    read_logs,
    train_drafter,
)
from .losses import (
    answer_positions,
    branch_valid,
    regime_loss,
    sample_anchors,
    sample_branches,
    step_mask,
)
from .online import OnlineBatches, online_eval_set, target_batch
from .resume import LOG_TABLES, SOURCE_KEYS, resume_source, trained_alike
from .schedule import SCHEDULES, curve_steps, lr_factor, run_end
from .state import read_train_state
from .stretches import MACHINE_COLS, by_stretch, known_machines, stretches

__all__ = [
    "SCHEDULES",
    "curve_steps",
    "lr_factor",
    "BatchOrder",
    "DATA_SOURCES",
    "EarlyStopping",
    "annealed_plateau",
    "converged_budget",
    "convergence_table",
    "se_acc",
    "se_ce",
    "EvalSet",
    "BranchOutcome",
    "branch_outcomes",
    "GROUPS",
    "GradProbe",
    "KV_CONDITIONS",
    "LOG_TABLES",
    "SOURCE_KEYS",
    "Objective",
    "OnlineBatches",
    "PROBE_TABLES",
    "StoreBatches",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "batch_from_target",
    "branch_valid",
    "budget_note",
    "build_draft_vocab",
    "carried_ahead",
    "build_optimizer",
    "collate",
    "combined_table",
    "evaluate_per_step",
    "finished_config",
    "finished_extra",
    "gate_summary",
    "machine_of",
    "MACHINE_COLS",
    "by_stretch",
    "known_machines",
    "stretches",
    "run_machine",
    "run_stretches",
    "grad_stats",
    "greedy_targets",
    "grouped_parameters",
    "heldout_acceptance",
    "init_from_checkpoint",
    "kv_ablation_table",
    "kv_gradient_summary",
    "load_probe_tables",
    "make_accelerator",
    "new_drafter",
    "online_eval_set",
    "param_group",
    "parse_drafter_specs",
    "per_step_table",
    "plateau",
    "plateau_step",
    "stable_plateau",
    "read_logs",
    "read_carried",
    "read_train_state",
    "resume_source",
    "regime_loss",
    "portable_init",
    "answer_positions",
    "run_end",
    "run_summary",
    "sample_anchors",
    "rewarm_factor",
    "sample_branches",
    "spearman",
    "step_mask",
    "target_batch",
    "target_sequence",
    "train_drafter",
    "trained_alike",
    "write_carried",
    "training_times",
    "with_target_kv",
    "zero_target_kv",
]
