"""The reference run's plan: the ``reference`` section of a profile as validated rows.

A row is one line of the paper's Table 5 at SmolLM2 scale: a name, the :class:`TrainConfig` parameters that
differ from the shared ``training`` ones, and keys of its own:

* ``like: <row>`` starts from another row's parameters (seeds, the original-responses control);
* ``init_from: <row>`` starts its weights from that row's trained checkpoint (the paper's "from the EAGLE-3
  checkpoint"); ``init_from: target`` starts a KV drafter's attention from the target layers it reads (a
  :class:`TrainConfig` value); ``kv_mode: best`` takes the profile's ``best_kv_mode``;
* ``responses: original | regenerated`` overrides the data's responses for this row;
* ``loops: drop`` trains without the conversations one of whose answers ends in a loop
  (:func:`~kvshot_lib.corpus.looping_conversations`; the regenerated answers of a small target often do);
  ``loops: cut`` keeps them, with each loop cut after its first repetition (:func:`~kvshot_lib.corpus.cut_looping`);
  ``loops: keep`` (the default) trains on the answers as generated;
* ``data: {...}`` and ``budget: {...}`` override the plan's for this row (a later stage's row on a larger slice
  of the regeneration, with its own cap), as ``--data`` and ``--budget`` override both for a run.

Beside the rows: ``data`` (the ShareGPT slices), ``budget`` (``token_passes``: the cap every row trains to at
most, turned into optimizer steps on the data, see :func:`~.data.train_steps_for`), ``checkpoints`` (the limits
of the committed checkpoints), ``eval`` (MT-bench; ``rows`` defaults to every trained row) and ``notebooks``
(parameters of the profile's notebooks when the run executes them).

:func:`load_plan` validates all of it (unknown rows, cycles, bad parameters) before anything runs;
``smoke=True`` applies the profile's ``smoke`` overrides (the whole path on a tiny target on the CPU), and the run
then writes under ``<profile>-smoke`` (:attr:`Plan.run_name`) so it never overwrites the real run's outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..runner import load_profile
from ..training import TrainConfig, TrainConfigError

ROW_KEYS = ("name", "like", "headline", "responses", "paper", "loops", "data", "budget", "carry")
RESPONSES = ("regenerated", "original")
LOOPS = ("keep", "drop", "cut")
BUDGET_KEYS = ("token_passes",)


class PlanError(ValueError):
    """The profile's reference section is invalid; the message says where and why."""


@dataclass
class Row:
    name: str
    params: dict  # TrainConfig parameters (shared training merged with the row's own)
    headline: bool = False
    responses: str = "regenerated"
    init_row: str | None = None  # the row whose checkpoint init_from names
    paper: str = ""  # the line of the paper's Table 5 this row stands for (reference_table.csv)
    loops: str = "keep"  # answers that loop: kept, their conversations dropped, or the loops cut
    data: dict = field(default_factory=dict)  # the row's own data keys, over the plan's
    budget: dict = field(default_factory=dict)  # the row's own budget (token_passes), over the plan's
    carry: bool = False  # keep its position in checkpoints/<run>/<row>.partial/, to go on in another session

    def train_config(self, **overrides) -> TrainConfig:
        return TrainConfig.from_params({**self.params, "name": self.name, **overrides})


@dataclass
class Plan:
    profile: str
    target: str
    device: str
    dtype: str
    seed: int
    data: dict
    training: dict
    rows: dict[str, Row]
    eval: dict
    smoke: bool = False
    budget: dict = field(default_factory=dict)  # token_passes: the cap of every row
    checkpoints: dict = field(default_factory=dict)  # max_file_mb, max_total_mb
    notebooks: dict = field(default_factory=dict)  # parameters of the profile's notebooks in the run
    comparisons: list = field(
        default_factory=list
    )  # [(drafter, minus)]: gaps by budget beside the standard ones
    baseline: dict = field(default_factory=dict)  # {run, rows: {row: its row in that run}} (on MT-bench)

    @property
    def run_name(self) -> str:
        """The folder name of the run's outputs (runs/, figures/, checkpoints/): the profile's, or ``-smoke``."""
        return f"{self.profile}-smoke" if self.smoke else self.profile

    def row_data_spec(self, row: Row) -> dict:
        """The data ``row`` trains on: the plan's ``data`` with the row's own keys over it."""
        return {**self.data, **row.data}

    def row_budget(self, row: Row) -> dict:
        """The budget ``row`` trains to: the plan's ``budget`` with the row's own keys over it."""
        return {**self.budget, **row.budget}

    def override(self, data: dict | None = None, budget: dict | None = None) -> None:
        """A run's ``--data`` and ``--budget``: over the plan's and every row's own, checked against the keys."""
        data, budget = data or {}, budget or {}
        unknown = sorted(set(data) - set(self.data))
        if unknown:
            raise PlanError(f"--data names {unknown}; the plan's data keys are {sorted(self.data)}.")
        if set(budget) - set(BUDGET_KEYS):
            raise PlanError(f"--budget takes token_passes=N, got {sorted(budget)}.")
        self.data.update(data)
        self.budget.update(budget)
        for row in self.rows.values():
            row.data.update({k: v for k, v in data.items() if k in row.data})
            row.budget.update({k: v for k, v in budget.items() if k in row.budget})

    def row(self, name: str) -> Row:
        if name not in self.rows:
            raise PlanError(f"unknown row {name!r}; the plan's rows are {list(self.rows)}.")
        return self.rows[name]

    def headline_rows(self) -> list[str]:
        return [n for n, r in self.rows.items() if r.headline]

    def training_order(self) -> list[str]:
        """Every row, in the order it trains: the plan's."""
        return list(self.rows)

    def eval_rows(self) -> list[str]:
        """The rows measured on MT-bench: ``eval.rows``, else every row."""
        return list(self.eval.get("rows") or self.rows)

    def baseline_pairs(self) -> list[tuple[str, str]]:
        """``[(row, "<its row>@<run>")]``: each row beside the committed checkpoint of the same paradigm in the
        ``baseline`` run (the on-policy rows beside the reference run's; ``rows`` maps a row to one row there, or
        to a list), compared on the same MT-bench turns."""
        if not self.baseline:
            return []
        run = self.baseline["run"] + ("-smoke" if self.smoke else "")
        pairs = []
        for row, bases in self.baseline["rows"].items():  # one row of that run, or a list of them
            pairs += [(row, f"{base}@{run}") for base in ([bases] if isinstance(bases, str) else bases)]
        return pairs


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (extra or {}).items():
        out[k] = (
            _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


def load_plan(profile: str = "reference", smoke: bool = False) -> Plan:
    """The validated plan of ``profile``'s ``reference`` section (with its ``smoke`` overrides if asked)."""
    prof = load_profile(profile)
    import yaml

    from ..runner import PROFILE_DIR

    path = PROFILE_DIR / f"{profile}.yaml" if (PROFILE_DIR / f"{profile}.yaml").is_file() else profile
    raw = (yaml.safe_load(open(path)) or {}).get("reference")
    if not isinstance(raw, dict):
        raise PlanError(f"profile {prof.name!r} has no 'reference' section (the rows of the reference run).")
    params = dict(prof.parameters)
    if smoke:
        sm = raw.get("smoke") or {}
        params.update(sm.get("parameters") or {})
        raw = _merge(raw, {k: v for k, v in sm.items() if k != "parameters"})
    training = dict(raw.get("training") or {})
    training.setdefault("seed", params.get("seed", 0))
    rows = _rows(
        raw.get("rows") or [],
        training,
        raw.get("best_kv_mode", "concat"),
        raw["data"],
    )
    bad = [c for c in raw.get("comparisons") or [] if len(c) != 2 or not set(c) <= set(rows)]
    if bad:
        raise PlanError(f"comparisons must be [drafter, minus] pairs of the plan's rows; got {bad}.")
    baseline = dict(raw.get("baseline") or {})
    if baseline and (
        not isinstance(baseline.get("run"), str) or not set(baseline.get("rows") or {}) <= set(rows)
    ):
        raise PlanError(
            f"baseline must be {{run: <profile>, rows: {{<row of this plan>: <row there>}}}}; got {baseline}."
        )
    ev = raw.get("eval") or {}
    unknown = [r for r in ev.get("rows") or [] if r not in rows]
    if unknown:
        raise PlanError(f"eval.rows names rows {unknown} that the plan does not define.")
    plan = Plan(
        profile=prof.name,
        target=params["target"],
        device=params.get("device", "auto"),
        dtype=params.get("dtype", "auto"),
        seed=int(params.get("seed", 0)),
        data=raw["data"],
        training=training,
        rows=rows,
        eval=ev,
        smoke=smoke,
        budget=dict(raw.get("budget") or {}),
        checkpoints=dict(raw.get("checkpoints") or {}),
        notebooks=dict(raw.get("notebooks") or {}),
        comparisons=[tuple(c) for c in raw.get("comparisons") or []],
        baseline=baseline,
    )
    if (
        smoke
    ):  # the smoke slice and cap over every row's own too (a later stage's row trains on the smoke slice)
        plan.override(sm.get("data"), sm.get("budget"))
    return plan


def _rows(specs: list, training: dict, best_kv_mode: str, data: dict) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    raw_by_name = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or "name" not in spec:
            raise PlanError(f"rows[{i}] must be a mapping with a 'name', got {spec!r}.")
        if spec["name"] in raw_by_name:
            raise PlanError(f"row {spec['name']!r} appears twice.")
        raw_by_name[spec["name"]] = spec
    for name, spec in raw_by_name.items():
        own = dict(spec)
        seen = {name}
        while "like" in own:  # inherit another row's parameters
            base = own.pop("like")
            if base not in raw_by_name or base in seen:
                raise PlanError(f"row {name!r}: 'like: {base}' names no earlier row (or a cycle).")
            seen.add(base)
            skip = ("name", "headline", "paper")
            own = {**{k: v for k, v in raw_by_name[base].items() if k not in skip}, **own}
        headline, carry = bool(own.pop("headline", False)), bool(own.pop("carry", False))
        paper = str(own.pop("paper", ""))
        resp = own.pop("responses", data.get("responses", "regenerated"))
        own_data, own_budget = dict(own.pop("data", None) or {}), dict(own.pop("budget", None) or {})
        if set(own_data) - set(data) or set(own_budget) - set(BUDGET_KEYS):
            raise PlanError(
                f"row {name!r}: its data keys must be the plan's ({sorted(data)}) and its budget keys "
                f"{list(BUDGET_KEYS)}; got data {sorted(own_data)}, budget {sorted(own_budget)}."
            )
        loops = own.pop("loops", "keep")
        if loops not in LOOPS:
            raise PlanError(f"row {name!r}: loops must be one of {LOOPS}, got {loops!r}.")
        own.pop("name")
        if resp not in RESPONSES:
            raise PlanError(f"row {name!r}: responses must be one of {RESPONSES}, got {resp!r}.")
        if own.get("kv_mode") == "best":
            own["kv_mode"] = best_kv_mode
        init_row = own.pop("init_from", None)
        if (
            init_row == "target"
        ):  # a TrainConfig value (the KV drafter's attention from the target), not a row
            own["init_from"], init_row = "target", None
        if init_row is not None and init_row not in raw_by_name:
            raise PlanError(f"row {name!r}: init_from names {init_row!r}, which is not a row of the plan.")
        params = {**training, **own}
        try:
            TrainConfig.from_params({**params, "name": name})
        except TrainConfigError as e:
            raise PlanError(f"row {name!r}: {e}") from None
        rows[name] = Row(name, params, headline, resp, init_row, paper, loops, own_data, own_budget, carry)
    return rows
