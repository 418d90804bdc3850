"""Re-judge every committed run's rows under the convergence rule (``training/convergence.py``), from their tables.

For each run folder under ``figures/`` with an annealed curve (``curve_points.csv``, or ``learning_curves.csv``
where a run kept acc_0 only), writes ``data/convergence.csv`` (one row per drafter: converged, compute-limited or
undetermined, with the gains over the last doubling of token-passes and their noise), and rewrites the on-policy
and reference runs' ``reference_table.csv`` with its ``convergence`` columns. No model is loaded.

    .venv/bin/python scripts/reference/rejudge_convergence.py
"""

from __future__ import annotations

import pandas as pd

from kvshot_lib.reference import tables
from kvshot_lib.target import assets
from kvshot_lib.training import convergence_table


def rejudge(data) -> list[str]:
    written = []
    for name in ("curve_points.csv", "learning_curves.csv"):
        if (data / name).is_file():
            convergence_table(pd.read_csv(data / name)).to_csv(data / "convergence.csv", index=False)
            written.append("convergence.csv")
            break
    if (data / "reference_rows.csv").is_file():
        found = {t: pd.read_csv(data / t) if (data / t).is_file() else pd.DataFrame() for t in tables.KEYS}
        tables.reference_table(found).to_csv(data / "reference_table.csv", index=False)
        written.append("reference_table.csv")
    return written


if __name__ == "__main__":
    for data in sorted((assets.REPO_ROOT / "figures").glob("*/data")):
        print(data.relative_to(assets.REPO_ROOT), rejudge(data))
