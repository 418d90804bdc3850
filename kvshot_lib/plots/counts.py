"""What each figure's caption line counts (draft attempts, held-out positions, prompts, the machine) and the
rows it names: functions of a figure's tables, named by :class:`~.registry.FigureSpec` ``counts``."""

from __future__ import annotations

from . import acceptance


def n_range(values) -> str:
    if not len(values):  # e.g. no step reached the attempts a point needs
        return "0"
    lo, hi = int(min(values)), int(max(values))
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def per_step_counts(t):
    n = t["per_step_accuracy.csv"]["n"]
    return f"each point: {n_range(n)} held-out positions; band: 95% Wilson interval"


def acceptance_counts(t):
    d = t["acceptance_by_step.csv"]
    d = d[d["mode"] == ("chain" if (d["mode"] == "chain").any() else d["mode"].iloc[0])]
    shown = d["n_attempts"][d["n_attempts"] >= acceptance.REACH_MIN]
    turns = t.get("acceptance_bootstrap.csv")
    over = (
        f" over {n_range(turns['n_generations'])} turns"
        if turns is not None and "n_generations" in turns
        else ""
    )
    return f"each point: {n_range(shown)} draft attempts{over}; {acceptance.caption()}"


def speedup_counts(t):
    d = t["speedup.csv"]
    prompts = f"{int(d['n_prompts'].max())} prompts" if "n_prompts" in d else "MT-bench prompts"
    machine = d["machine"].iloc[0] if "machine" in d and len(d) else "this machine"
    reps = int(d["n_reps"].max()) if "n_reps" in d else 1
    if reps > 1:
        return f"each point: {prompts}, median of {reps} interleaved repetitions on {machine} (bars: min-max)"
    return f"each point: {prompts}, one run on {machine}"


def stopped_rows(t):
    """The points of the rows whose training stopped short (``stopped_curves.csv``, where present), less any row
    that has since finished (is in ``learning_curves.csv``)."""
    stopped = t.get("stopped_curves.csv")
    return None if stopped is None else stopped[~stopped["drafter"].isin(t["learning_curves.csv"]["drafter"])]


def curve_counts(t):
    counts = (
        f"{n_range(t['learning_curves.csv'].groupby('drafter')['tokens'].nunique())} budgets per drafter, "
        "each after a WSD decay branch "
        "(warmup-stable-decay; the last point is the run's own decay); bars: 95% intervals (Wilson; MAT: "
        "parametric bootstrap)"
    )
    stopped = stopped_rows(t)
    if stopped is None:
        return counts
    last = stopped.sort_values("tokens").groupby("drafter").last()
    return f"{counts}; stopped: " + ", ".join(
        f"{name} at step {int(r['saved_step']):,} of {int(r['train_steps']):,} "
        f"(last point {r['tokens'] / 1e6:.1f}M token-passes)"
        for name, r in last.iterrows()
    )


def specpv_counts(t):
    n = t["specpv_fidelity_runs.csv"].groupby(["context", "budget", "full_every", "mode"]).size().max()
    return (
        f"each point: {n} prompts; band: 95% bootstrap interval"
        if n > 1
        else "each point: one prompt (no interval)"
    )


def speed_machine(t, name="specpv_speed.csv"):
    d = t[name]
    return f"{int(d['n_prompts'].max())} prompts per context, one run on {d['machine'].iloc[0]}"


# how a cost model's format (the first field of its key, ``decoding.cost_model.FORMAT``) summarised its timings
COST_STATISTIC = {
    "costs/3": "verification: the fastest of repeated timings, drafter calls: their lower quartile"
}


def cost_counts(t):
    d = t["cost_models.csv"]
    if "key" not in d:
        return "repeated timings"
    fmt, machine = d["key"].iloc[0].split("|")[:2]
    return f"{COST_STATISTIC.get(fmt, 'the median of repeated timings')}; {machine}"


def sequences(table: str, what: str = "sequences"):
    return lambda t: (
        f"{t[table]['sequence'].nunique()} MT-bench {what} (target-greedy answers); band: 95% bootstrap over them"
    )


def probe_counts(t):
    d = t["probe_results.csv"]
    d = d[d["metric"] == "top1"]
    return (
        f"each point: {n_range(d['n_examples'])} test examples from {int(d['n_docs'].max())} held-out "
        f"ShareGPT documents, {int(d['n_seeds'].max())} seeds; band: 95% bootstrap over documents"
    )


def gap_counts(t):
    g = t["mtbench_gap.csv"]
    n = int(g.loc[g["name"] == "mtbench_tf", "n"].max())
    return (
        "parts: held-out whole answers vs their first 64 tokens; held-out vs MT-bench prompts "
        f"({n:,} MT-bench positions); every token vs the tokens after a miss (cycle starts); teacher forcing at "
        "those vs chain decoding. Bars: 95% bootstrap over conversations and turns; lines: step 0, held-out solid, "
        "MT-bench dashed"
    )


def memorization_counts(t):
    g = t["memorization_gap.csv"]
    return (
        f"{n_range(g['conversations_seen'])} seen and {n_range(g['conversations_unseen'])} unseen conversations "
        "a drafter; bars: 95% bootstrap over conversations, each set resampled on its own (paired: the same "
        "conversations for both drafters)"
    )
