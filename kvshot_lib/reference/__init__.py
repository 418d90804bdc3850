"""The reference run: the paper's Table 5 at SmolLM2 scale, trained to convergence (issue 13).

It sits on top of the stages, like the runner. The plan comes from a profile's ``reference`` section
(:mod:`.plan`: the rows, their training settings, the data, the evaluation); :mod:`.run` regenerates the
responses, trains the rows and evaluates them on MT-bench on this machine; :mod:`.tables` writes the run's
tables (Table 5 among them) and figures into ``runs/<profile>/`` and ``figures/<profile>/``. The command line is
``python -m kvshot_lib.reference`` (:mod:`.__main__`); README's "Reference run" section shows the calls.

A remote GPU with limits of its own (minutes per command, files per call) is a transport, not a stage:
``scripts/reference/`` packs the assets, time-boxes jobs around these functions and merges what comes back.
"""

from . import plan, run, tables
from .plan import Job, Plan, PlanError, Row, load_plan
from .run import run_reference
from .tables import update_run

__all__ = [
    "Job",
    "Plan",
    "PlanError",
    "Row",
    "load_plan",
    "plan",
    "run",
    "run_reference",
    "tables",
    "update_run",
]
