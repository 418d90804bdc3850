"""The reference run: the KVShot paper's headline drafters at SmolLM2 scale, trained to a plateau (issue 19).

It sits on top of the stages, like the runner. The plan comes from a profile's ``reference`` section
(:mod:`.plan`: the rows, their training settings, the data, the budget, the evaluation); :mod:`.data` makes the
ShareGPT slices and their feature store; :mod:`.run` trains the rows one after the other (resumably), evaluates
them on MT-bench and runs the profile's notebooks; :mod:`.heldout` measures a run's and its baseline run's
checkpoints on both runs' held-out sets; :mod:`.checkpoints` copies the headline rows to
``checkpoints/<run>/``; :mod:`.tables` writes the run's tables (Table 5 among them) and figures into
``runs/<run>/`` and ``figures/<run>/``. The command line is ``python -m kvshot_lib.reference``
(:mod:`.__main__`); README's "Reference run" section shows the calls.
"""

from . import checkpoints, data, heldout, plan, run, tables
from .checkpoints import carried_folder, carry_saver, checkpoint_folders, commit_checkpoint, folder_bytes
from .heldout import cross_heldout, heldout_sets
from .plan import Plan, PlanError, Row, load_plan
from .run import init_path, kv_ablation, run_reference, status
from .tables import merged_table, replace_rows, update_run

__all__ = [
    "Plan",
    "PlanError",
    "Row",
    "carried_folder",
    "carry_saver",
    "checkpoint_folders",
    "checkpoints",
    "commit_checkpoint",
    "cross_heldout",
    "data",
    "folder_bytes",
    "heldout",
    "heldout_sets",
    "init_path",
    "kv_ablation",
    "load_plan",
    "merged_table",
    "plan",
    "replace_rows",
    "run",
    "run_reference",
    "status",
    "tables",
    "update_run",
]
