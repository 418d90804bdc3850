"""The ``greedy_equality`` stages: chain and tree speculative decoding on the fast path against plain decoding, in
the target's dtype and in float32, with fresh drafters and the target drafting for itself."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, generate
from kvshot_lib.drafters import SelfDrafter, build_drafter, drafter_config_for, drafter_for_target
from kvshot_lib.target import Target
from kvshot_lib.target import forward as target_forward

from .scales import PARADIGMS, Scale


def near_ties(target: Target, prompt: list[int], tokens: list[int], tie_fraction: float) -> list[bool]:
    """For each of plain decoding's ``tokens``: whether the logits it was chosen from (one forward of the prompt
    and the tokens before it) had a top-2 gap under ``tie_fraction`` of their standard deviation."""
    dev = target.model.device
    ids = torch.tensor([prompt + tokens[:-1]], device=dev)
    logits = target_forward.forward(target.model, ids).logits[0, len(prompt) - 1 :].float()  # [n, V]
    top = logits.topk(2, dim=-1).values  # [n, 2]
    return ((top[:, 0] - top[:, 1]) < tie_fraction * logits.std(dim=-1)).tolist()


def greedy_equality(target: Target, drafters: dict, prompts: list[list[int]], scale: Scale) -> dict:
    """Every drafter, chain and tree, on the fast path, on every prompt, against plain decoding in the same dtype;
    ``equal_until_tie``: the outputs agree at least up to plain decoding's first near-tie (:func:`near_ties`)."""
    base = DecodeConfig(
        max_new_tokens=scale.equality_tokens, stop_token_ids=(), chain_depth=scale.chain_depth, **scale.tree
    )
    rows, ties = [], []
    for i, prompt in enumerate(prompts):
        plain = autoregressive_generate(
            target, prompt, replace(base, mode="ar", target_cache="dynamic")
        ).token_ids
        tied = near_ties(target, prompt, plain, scale.tie_fraction)
        first_tie = next((j for j, t in enumerate(tied) if t), None)
        ties += tied
        for name, drafter in drafters.items():
            for mode in ("chain", "tree"):
                r = generate(target, prompt, replace(base, mode=mode, target_cache="static"), drafter=drafter)
                diverge = next((j for j, (a, b) in enumerate(zip(r.token_ids, plain)) if a != b), None)
                rows.append(
                    dict(
                        drafter=name,
                        mode=mode,
                        prompt=i,
                        equal=r.token_ids == plain,
                        first_divergence=diverge,
                        first_near_tie=first_tie,
                        equal_until_tie=diverge is None or (first_tie is not None and diverge >= first_tie),
                        tokens=len(r.token_ids),
                        mat=1 + sum(r.accepted_per_cycle) / max(1, r.n_cycles),
                    )
                )
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    return dict(
        dtype=dtype,
        equal=sum(r["equal"] for r in rows),
        equal_until_tie=sum(r["equal_until_tie"] for r in rows),
        of=len(rows),
        near_tie_share=round(sum(ties) / max(1, len(ties)), 4),
        rows=rows,
    )


def fresh_drafters(target: Target, d2t, seed: int) -> dict:
    """Untrained hidden, KV and hybrid drafters at the check's draft vocabulary (exactness and cost do not need
    training)."""
    return {
        f"{p}-ttt": build_drafter(
            drafter_config_for(target, p, draft_vocab_size=len(d2t)), target, d2t, seed=seed
        )
        for p in PARADIGMS
    }


def bound(drafters: dict, target: Target, dtype: torch.dtype) -> dict:
    """``drafters`` bound to ``target`` in ``dtype`` (as decoding runs them), and ``self`` (the target drafting for
    itself): its drafts are accepted, so multi-token commits are checked too."""
    out = {name: drafter_for_target(d, target, dtype) for name, d in drafters.items()}
    return {**out, "self": SelfDrafter(target)}


def float32_in_place(target: Target, device: str) -> Target | None:
    """The target cast to float32 in place (its last use), or None where the GPU's free memory cannot hold it."""
    if device.startswith("cuda"):
        held = sum(p.numel() * p.element_size() for p in target.model.parameters())
        need = sum(p.numel() * 4 for p in target.model.parameters())
        if torch.cuda.mem_get_info()[0] + held < 1.1 * need:
            return None
    model = target.model.float()
    return Target(model=model, tokenizer=target.tokenizer, info=replace(target.info, dtype="float32"))
