"""The ``replayed_acceptance`` stage: each paradigm's drafter at the target's shape, timed at the KVShot paper's
acceptance (:mod:`kvshot_lib.decoding.replay`): real drafting and verification, each cycle's accepted length drawn
from the paper's Table 5 row (trees: Table 4's MAT), plain decoding's tokens committed."""

from __future__ import annotations

import csv
import traceback
from dataclasses import replace

import torch

from kvshot_lib.decoding import (
    DecodeConfig,
    ReplayedAcceptance,
    autoregressive_generate,
    draft_capture_seconds,
    mat_of,
    profile_for_mat,
    speculative_generate,
)
from kvshot_lib.drafters import build_drafter, drafter_config_for, drafter_for_target
from kvshot_lib.target import Target

from .scales import PAPER_TABLE5, REPLAYED, Scale


def paper_profiles(names: tuple[str, ...]) -> dict:
    """Each replayed drafter's per-step acceptance (the paper's Table 5 row, ``figures/onpolicy/data/paper_table5.csv``),
    its chain MAT, and its tree MAT: Table 4's where the paper has one, else hidden's scaled by the (MAT - 1) ratio of
    the two chains (Table 4 reports no KV-only tree)."""
    with open(PAPER_TABLE5, newline="") as f:
        table = {r["paper_row"]: r for r in csv.DictReader(f)}

    def alphas(row: str) -> tuple[float, ...]:
        return tuple(float(table[row][f"alpha_{k}"]) for k in range(7))

    hidden = REPLAYED["hidden"]
    hidden_chain = mat_of(alphas(hidden[3]), 7)
    out = {}
    for name in names:
        _, _, _, row, tree_mat = REPLAYED[name]
        chain = mat_of(alphas(row), 7)
        source = "Table 4"
        if tree_mat is None:
            tree_mat = 1 + (hidden[4] - 1) * (chain - 1) / (hidden_chain - 1)
            source = "scaled from Table 4's hidden tree by Table 5's (MAT - 1) ratio"
        out[name] = dict(
            paper_row=row, alphas=alphas(row), chain_mat=chain, tree_mat=tree_mat, tree_mat_source=source
        )
    return out


def replay_drafters(target: Target, d2t, scale: Scale, dtype: torch.dtype, seed: int) -> dict:
    """The replayed drafters at the target's shape (untrained: their cost is what counts), in ``dtype``, their LM
    head sharpened by ``scale.replay_sharpen`` (a trained drafter's confident, deep tree; the same arithmetic)."""
    out = {}
    for name in scale.replay_drafters:
        paradigm, layers, kv_mode, *_ = REPLAYED[name]
        cfg = drafter_config_for(target, paradigm, n_layers=layers, kv_mode=kv_mode, draft_vocab_size=len(d2t),
                                 kv_recency=32, name=name)  # fmt: skip
        out[name] = drafter_for_target(build_drafter(cfg, target, d2t, seed=seed), target, dtype)
        with torch.no_grad():
            out[name].head.mul_(scale.replay_sharpen)
    return out


def replayed_acceptance(target: Target, drafters: dict, prompts: list[list[int]], scale: Scale) -> dict:
    """Speculative decoding at the paper's acceptance (``decoding/replay.py``): each drafter drafts for real (a chain
    of ``replay_chain_depth``; Table 4's tree), the target verifies for real, each cycle's accepted length is drawn
    from the drafter's Table 5 profile (trees: stretched to the tree's MAT) and plain decoding's tokens are
    committed. Tokens/s over the decode (prefill excluded), against plain decoding on the same fast path."""
    n = scale.replay_tokens
    plain_cfg = DecodeConfig(mode="ar", max_new_tokens=n, stop_token_ids=(), target_cache="static")
    for p in prompts:  # warm-up: every cache size's graph
        autoregressive_generate(target, p, replace(plain_cfg, max_new_tokens=4))
    refs = [autoregressive_generate(target, p, plain_cfg) for p in prompts]
    plain_tps = sum(len(r.token_ids) - 1 for r in refs) / sum(r.total_s - r.prefill_s for r in refs)
    profiles = paper_profiles(tuple(drafters))
    base = DecodeConfig(max_new_tokens=n, stop_token_ids=(), chain_depth=scale.replay_chain_depth,
                        target_cache="static", **scale.replay_tree)  # fmt: skip
    rows = []
    for name, drafter in drafters.items():
        prof = profiles[name]
        for mode in ("chain", "tree"):
            if mode == "chain":
                alphas = prof["alphas"]
                aim = mat_of(alphas, scale.replay_chain_depth)
            else:
                depth = scale.replay_tree["tree_depth"]
                aim = min(prof["tree_mat"], depth + 1)
                alphas = profile_for_mat(prof["alphas"], aim, depth)
            row = dict(drafter=name, mode=mode, paper_row=prof["paper_row"], aimed_mat=round(aim, 3))
            for loop in ("device", "host"):  # the host loop where the device loop failed: numbers either way
                try:
                    cfg = replace(base, mode=mode, draft_loop=loop)
                    row.update(
                        replayed_runs(target, drafter, prompts, refs, cfg, alphas, plain_tps), draft_loop=loop
                    )
                    row.pop("error", None)
                    break
                except Exception as e:  # the other rows still run
                    traceback.print_exc()
                    row["error"] = f"{loop} loop: {type(e).__name__}: {e}"
            rows.append(row)
    for row in rows:  # the KV and hybrid drafters' drafting time against the hidden one's, same mode
        base_row = next((r for r in rows if r["drafter"] == "hidden" and r["mode"] == row["mode"]), {})
        if "draft_ms" in row and "draft_ms" in base_row:
            row["draft_vs_hidden"] = round(row["draft_ms"] / base_row["draft_ms"] - 1, 4)
    return dict(
        label="replayed acceptance: real drafting and verification, each cycle's accepted length drawn from the "
        "paper's acceptance (Table 5 per step; Table 4's tree MAT), plain decoding's tokens committed",
        plain_tokens_per_s=round(plain_tps, 2),
        tokens=n,
        prompts=len(prompts),
        tree_mat_sources={k: v["tree_mat_source"] for k, v in profiles.items()},
        rows=rows,
    )


def replayed_runs(
    target: Target, drafter, prompts, refs, cfg: DecodeConfig, alphas, plain_tps: float
) -> dict:
    """One drafter and mode of :func:`replayed_acceptance`: a warm-up, then one generation per prompt."""
    ref = refs[0].token_ids
    speculative_generate(
        target,
        drafter,
        prompts[0],
        replace(cfg, max_new_tokens=min(16, len(ref))),
        replay=ReplayedAcceptance(ref, alphas),
    )  # fmt: skip  (captures the draft loop's graph)
    runs = [
        speculative_generate(target, drafter, p, cfg, replay=ReplayedAcceptance(r.token_ids, alphas, seed=i))
        for i, (p, r) in enumerate(zip(prompts, refs))
    ]
    cycles = sum(r.n_cycles for r in runs)
    tps = sum(len(r.token_ids) - 1 for r in runs) / sum(r.total_s - r.prefill_s for r in runs)
    return dict(
        mat=round(1 + sum(sum(r.accepted_per_cycle) for r in runs) / max(1, cycles), 3),
        tokens_per_s=round(tps, 2),
        speedup=round(tps / plain_tps, 3),
        draft_ms=round(1e3 * sum(r.draft_s for r in runs) / max(1, cycles), 3),
        verify_ms=round(1e3 * sum(r.verify_s for r in runs) / max(1, cycles), 3),
        commit_ms=round(1e3 * sum(r.commit_s for r in runs) / max(1, cycles), 3),
        nodes_per_cycle=round(sum(sum(r.drafted_per_cycle) for r in runs) / max(1, cycles), 2),
        cycles=cycles,
        equal_to_plain=sum(r.token_ids == q.token_ids for r, q in zip(runs, refs)),
        draft_capture_s=round(draft_capture_seconds(drafter), 2),
    )
