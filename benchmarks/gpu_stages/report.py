"""The check's result on disk: ``gpu_check_<machine>.json`` and its markdown table, written after every stage."""

from __future__ import annotations

import json
from pathlib import Path

from .scales import TRAINING_ROWS


def markdown(result: dict) -> str:
    s = result["stages"]
    mem = "peak GPU memory (GiB)" if result["device"].startswith("cuda") else "peak RSS (GiB)"
    state = "" if result.get("complete") else " (**incomplete**: the run stopped after the stages below)"
    lines = [
        f"# gpu_check on {result['machine']['gpu'] or result['machine']['cpu']} (scale {result['scale']})",
        "",
        f"{result.get('target', {}).get('vocabulary_note', '')}. torch {result['versions']['torch']}, transformers "
        f"{result['versions']['transformers']}; {result.get('total_seconds')} s in all{state}.",
        "",
        f"| measurement | value | {mem} | seconds |",
        "| --- | --- | --- | --- |",
    ]

    def row(name: str, what: str, value) -> None:
        if name not in s:
            return
        r = s[name]
        shown = r.get("error") or r.get("skipped") or value(r)
        lines.append(f"| {what} | {shown} | {r.get('peak_memory_gib', '')} | {r.get('seconds', '')} |")

    row("build", "target built (parameters)", lambda r: f"{r['n_params']:,} in {r['dtype']}")
    row("plain_decoding", "plain decoding, eager (DynamicCache)", lambda r: f"{r['tokens_per_s']} tok/s")
    row(
        "plain_decoding",
        "plain decoding, fast path",
        lambda r: (
            f"{r['graphs_tokens_per_s']} tok/s ({r['graphs_speedup']}x eager; {r['fast_path']}; "
            f"warm-up {r['graphs_warmup_s']} s, of it capture {r['capture_s']} s; {r['same_tokens']} of "
            f"{r['prompts']} outputs as eager's)"
        ),
    )
    row(
        "verification_cost",
        "c_v(1)",
        lambda r: (
            f"{r['k1_ms']:.2f} ms fast path, {r['eager_k1_ms']:.2f} ms eager, on {r['context']} cached tokens"
        ),
    )
    for mode in ("chain", "tree", "chain_host", "tree_host"):
        loop = "host loop" if mode.endswith("_host") else "device loop"
        row(
            "cycle_overhead",
            f"one {mode.removesuffix('_host')} cycle outside the verify forward ({loop})",
            lambda r, m=mode: (
                (
                    r[m].get("error")
                    or f"{r[m]['overhead_ms']:.2f} ms ({r[m]['overhead_over_cv1']:.2f} x c_v(1); drafting "
                    f"{r[m]['draft_ms']:.2f} ms, {r[m]['nodes_per_cycle']} nodes)"
                )
                if m in r
                else "not measured"
            ),
        )
    row(
        "compiled_forward",
        "plain decoding, fast path, norms and MLPs compiled",
        lambda r: (
            f"{r['tokens_per_s']} tok/s ({r['over_uncompiled']}x uncompiled; compile and capture "
            f"{r['compile_and_capture_s']} s; {r['same_tokens']} of {r['prompts']} outputs as uncompiled)"
        ),
    )
    for name in ("greedy_equality", "greedy_equality_fp32"):
        row(name, f"greedy equality ({name.removeprefix('greedy_equality').strip('_') or 'target dtype'})",
            lambda r: f"{r['equal']} of {r['of']} equal, {r['equal_until_tie']} up to the first near-tie "
            f"({r['dtype']}; {100 * r['near_tie_share']:.1f}% of plain decoding's steps are near-ties)")  # fmt: skip
    for name, *_ in TRAINING_ROWS:
        row(
            name,
            f"online training {name.removeprefix('train_')}",
            lambda r: f"{r['tokens_per_s']:,} tok/s ({r['timed_steps']} steps)",
        )
    row(
        "extraction", "extraction", lambda r: f"{r['tokens_per_s']:,} tok/s, {r['bytes_per_token']:,} B/token"
    )
    lines += replayed_table(s.get("replayed_acceptance", {}))
    rows = s.get("verification_cost", {}).get("rows", [])
    if rows:
        lines += [
            "",
            "c_v(k) on the fast path, relative to k=1:",
            "",
            "| k | chain | tree |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {r['k']} | {r['chain_rel']:.2f} | {r['tree_rel']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def replayed_table(r: dict) -> list[str]:
    """The replayed-acceptance stage as a table (none where it did not run)."""
    if "rows" not in r:
        return []
    out = [
        "",
        f"Speed at **replayed acceptance** ({r['label']}); plain decoding {r['plain_tokens_per_s']} tok/s on the same "
        f"fast path, {r['prompts']} prompt(s) x {r['tokens']} tokens:",
        "",
        "| drafter | mode | paper row | MAT aimed / drawn | tok/s | speedup | drafting ms / cycle | vs hidden's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x in r["rows"]:
        if "error" in x:
            out.append(f"| {x['drafter']} | {x['mode']} | {x['paper_row']} | {x['error']} | | | | |")
            continue
        vs = f"{100 * x['draft_vs_hidden']:+.1f}%" if "draft_vs_hidden" in x else ""
        mode = x["mode"] if x.get("draft_loop") == "device" else f"{x['mode']}, host loop"
        out.append(
            f"| {x['drafter']} | {mode} | {x['paper_row']} | {x['aimed_mat']} / {x['mat']} | "
            f"{x['tokens_per_s']} | {x['speedup']}x | {x['draft_ms']:.2f} | {vs} |"
        )
    return out


def write_results(result: dict, out_dir: Path) -> Path:
    suffix = "" if result["scale"] == "qwen3-8b" else f"_{result['scale']}"
    dest = Path(out_dir) / f"gpu_check_{result['machine']['name']}{suffix}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    dest.with_suffix(".md").write_text(markdown(result))
    return dest
