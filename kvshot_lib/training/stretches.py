"""A row trained over several sessions, cut into stretches at its restarts, with the machine of each.

A carried row (:mod:`.carry`) goes on from its committed position on whatever machine the next session has,
so its points and evaluations come from several CPUs and precisions. Each restart logs the machine that goes
on (``restarts``); :func:`stretches` cuts the history there, :func:`known_machines` fills a stretch that no
restart names (the first; restarts logged before they named one) from an earlier table of the same stretches,
and :func:`by_stretch` labels each logged step with the machine of the stretch that ran it.
``tests/test_reference_scripts.py`` checks them on a two-stretch history.
"""

from __future__ import annotations

import pandas as pd

# a longer gap between two logged steps held an evaluation or a decay branch (or the start)
PLAIN_STEP_S = 30.0
MACHINE_COLS = ("precision", "cpu", "bf16_isa")


def stretches(logs: dict, here: dict) -> list[dict]:
    """The row's history cut at each restart from a carried position (``restarts`` log), one dict per stretch:
    its steps, seconds and token-passes, and the rate of its plain steps, with the machine that ran it (the
    restart's record; ``here`` for the last stretch where no restart names one: the state was saved here)."""
    history = pd.DataFrame(logs.get("history", []), columns=["step", "seconds", "tokens"])
    restarts = logs.get("restarts", [])
    starts = [dict(step=0, seconds=0.0)] + restarts
    out = []
    for i, start in enumerate(starts):
        end = starts[i + 1]["step"] if i + 1 < len(starts) else float("inf")
        part = history[(history["step"] > start["step"]) & (history["step"] <= end)]
        gaps = part["seconds"].diff()  # the stretch's first step also took its start-up: never plain
        plain = gaps[gaps < PLAIN_STEP_S]
        machine = {k: start.get(k) for k in MACHINE_COLS}
        if i == len(starts) - 1 and pd.isna(machine["cpu"]):  # NaN: a restart read back from its CSV
            machine = {k: here.get(k) for k in MACHINE_COLS}
        out.append(
            dict(
                machine,
                from_step=start["step"],
                to_step=int(part["step"].max()) if len(part) else start["step"],
                seconds=part["seconds"].max() - start["seconds"] if len(part) else 0.0,
                token_passes=part["tokens"].sum(),
                plain_steps=len(plain),
                seconds_per_step=plain.mean(),
                token_passes_per_second=part["tokens"][plain.index].sum() / plain.sum()
                if len(plain)
                else None,
            )
        )
    return out


def known_machines(progress: pd.DataFrame, earlier: pd.DataFrame) -> pd.DataFrame:
    """``progress`` with the machine of each stretch no restart names taken from an ``earlier`` progress table:
    its row of that drafter for the stretch that began at the same step (``from_step``: a stretch resumed later
    from ``runs/``, without a restart, ends further on); in a table from before the stretches, its one row, saved
    at the stretch's end (``saved_step``) on that machine."""
    key = "from_step" if "from_step" in earlier else "to_step"  # the progress column to match on
    known = earlier.assign(key=earlier["from_step"] if key == "from_step" else earlier["saved_step"])
    known = known.dropna(subset=["cpu"]).drop_duplicates(["drafter", "key"], keep="last")
    known = known.set_index(["drafter", "key"])
    progress = progress.copy()
    for i, r in progress[progress["cpu"].isna()].iterrows():
        if (r["drafter"], r[key]) in known.index:
            for k in MACHINE_COLS:
                progress.at[i, k] = known.at[(r["drafter"], r[key]), k]
    return progress


def by_stretch(df: pd.DataFrame, progress: pd.DataFrame, step: str) -> pd.DataFrame:
    """``df`` with each row's machine taken from the ``progress`` stretch of its drafter that ran its step (column
    ``step``; step 0, the start's evaluation, is the first stretch's): a row trained over several sessions has
    points from several machines, and a carried state is read on a machine that ran none of them. A row no
    stretch covers keeps its own."""
    df = df.copy()
    for k in MACHINE_COLS:
        df[k] = df[k].astype(object) if k in df else None
    for _, s in progress.iterrows():
        at = df[step]
        ran = (df["drafter"] == s["drafter"]) & (
            ((s["from_step"] < at) & (at <= s["to_step"])) | ((at == 0) & (s["from_step"] == 0))
        )
        for k in MACHINE_COLS:
            df.loc[ran, k] = s[k]
    return df


def row_machine(progress: pd.DataFrame) -> dict:
    """One row's machine over all its stretches: each column's distinct values in the order they ran, joined
    with ``+`` (``bf16+fp32``: a row whose stretches differ says so instead of naming its last machine)."""
    out = {}
    for k in MACHINE_COLS:
        seen = [str(v) for v in dict.fromkeys(progress[k]) if pd.notna(v)]
        out[k] = "+".join(seen) if seen else None
    return out
