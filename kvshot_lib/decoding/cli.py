"""``kvshot generate``: decode one prompt with any drafter and mode.

    kvshot generate --drafter ngram --mode chain --mt-bench 1 --max-new-tokens 64 --json
    kvshot generate --drafter runs/default/drafters/kv-ttt --mode tree --prompt "Why is the sky blue?"
    kvshot generate --drafter ngram --verify partial --budget 512 --full-every 32 [--strict] --long-context 4096
    kvshot generate --drafter runs/default/drafters/hidden-ttt --mode tree --shape chosen --lookup --precision auto \
        --mt-bench 1

``--precision`` runs the target and the drafter in float32 (``fp32``, the exact reference) or bf16 (``bf16``;
``auto``: bf16 where the CPU has AMX-BF16/AVX512-BF16); ``--shape chosen`` picks each cycle's draft shape by
expected speed under the measured cost model (measured once per machine and precision, then cached);
``--lookup`` puts prompt lookup's continuation into the drafter's proposal.

Arguments are checked before the target is loaded: an unknown drafter, a drafter path that is not a
checkpoint folder, a drafter with ``--mode ar`` (or none with chain/tree), a negative temperature, or a
bad partial-verification setting (negative budget, a block size that does not divide it, P < 0), an empty or
non-UTF-8 ``--prompt``, ``--max-new-tokens`` below 1, a negative ``--threads`` and a weights file that is damaged or
not safetensors fail at once with a message saying what to pass instead (a
:class:`~kvshot_lib.user_errors.UsageError`, exit status 2); so do a checkpoint trained for another target and an
early exit deeper than the target, whenever ``--target``'s config can be read without its weights (the presets, a
local folder). What only the loaded target can tell (same architecture, other weights; a prompt longer than its
context) fails after loading, as one line too. ``tests/test_cli_errors.py`` runs each of these through the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..drafters.base import SessionFactory
from ..drafters.baselines import BASELINES, drafter_for_target, is_baseline_name, resolve_drafter
from ..drafters.checkpoint import check_weights, read_config
from ..drafters.eagle3_format import is_eagle3_folder
from ..target import Target, target_architecture
from ..target.precision import DECODE_PRECISIONS
from ..user_errors import UsageError
from .config import MODES, SHAPES, DecodeConfig
from .generate import generate
from .specpv import SpecPVConfig


def decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", default="smollm2-135m", help="preset, HF id or local path (default: smollm2-135m)"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless token for token)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chain-depth", type=int, default=4, help="drafted tokens per chain cycle (k)")
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument("--tree-top-k", type=int, default=4)
    p.add_argument("--tree-budget", type=int, default=24, help="draft nodes verified per tree cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")


def add_cli(sub) -> None:
    g = sub.add_parser("generate", help="decode a prompt (plain, chain or tree) and print the continuation")
    decode_args(g)
    g.add_argument(
        "--drafter", default="none", help=f"a checkpoint folder, or one of none, {', '.join(BASELINES)}"
    )
    g.add_argument(
        "--mode", default=None, choices=MODES, help="default: ar without a drafter, chain with one"
    )
    g.add_argument("--precision", default="fp32", choices=DECODE_PRECISIONS, help="fp32, bf16, or auto")
    g.add_argument("--shape", default="fixed", choices=SHAPES, help="chosen: by expected tokens per second")
    g.add_argument("--lookup", action="store_true", help="prompt lookup joins the drafter's proposal")
    pv = g.add_argument_group("partial verification (SpecPV)")
    pv.add_argument(
        "--verify", default="full", choices=("full", "partial"), help="partial: verify on a partial KV cache"
    )
    pv.add_argument("--budget", type=int, default=1024, help="tokens of sinks + retrieved blocks + window")
    pv.add_argument("--full-every", type=int, default=16, help="P: a full pass once P tokens are pending")
    pv.add_argument("--strict", action="store_true", help="re-check pending tokens at full passes (lossless)")
    pv.add_argument("--sink", type=int, default=32)
    pv.add_argument("--window", type=int, default=64)
    pv.add_argument("--block-size", type=int, default=16)
    pv.add_argument("--score", default="quest", choices=("quest", "vector"), help="block score")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat-templated unless --raw)")
    src.add_argument("--mt-bench", type=int, metavar="N", help="MT-bench question N (1..80), first turn")
    src.add_argument(
        "--long-context",
        type=int,
        metavar="TOKENS",
        help="a long ShareGPT summarization prompt of TOKENS tokens",
    )
    g.add_argument(
        "--raw", action="store_true", help="feed --prompt as plain text, without the chat template"
    )
    g.add_argument(
        "--json", action="store_true", help="print token_ids, text, accepted_per_cycle, tokens_per_s, ..."
    )
    g.set_defaults(func=_cli_generate)


def check_drafter_spec(spec: str, target: str | None = None) -> None:
    """Fail fast on a drafter argument that cannot work, before any model is loaded: an unknown name, a path
    that is not a (complete) checkpoint folder; and, when ``target``'s architecture can be read from its config
    alone (:func:`~kvshot_lib.target.target_architecture`), a checkpoint trained for another architecture or
    an early exit deeper than the target."""
    if spec == "none":
        return
    if is_baseline_name(spec):
        arch = target_architecture(target) if target and spec.startswith("early-exit-") else None
        n = int(spec.removeprefix("early-exit-")) if arch else 0
        if arch and not 1 <= n <= arch["n_layers"]:
            raise UsageError(
                f"--drafter {spec}: the target {target} has {arch['n_layers']} layers; use "
                f"early-exit-<n> with n in 1..{arch['n_layers']}."
            )
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise UsageError(
            f"unknown drafter {spec!r}: use none, {', '.join(BASELINES)}, early-exit-<n>, "
            "or the folder of a trained drafter (runs/<profile>/drafters/<name>/)."
        )
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise UsageError(
            f"{path} is not a drafter checkpoint: expected a folder with config.json and "
            "model.safetensors, as written by notebook 02."
        )
    try:
        check_weights(path)  # a damaged or foreign weights file: refused here, by its header alone
        if is_eagle3_folder(path):  # the shared EAGLE-3 layout: its widths are checked when it loads
            return
        cfg = read_config(path)
    except FileNotFoundError as e:
        raise UsageError(f"--drafter {spec}: {e}") from None
    arch = target_architecture(target) if target else None
    trained_for = (cfg.target_fingerprint, cfg.target_vocab_size)
    if arch and (arch["fingerprint"], arch["vocab_size"]) != trained_for:
        fix = (
            f"Pass --target {cfg.target_name}, or a drafter trained for {target}"
            if cfg.target_name != target
            else f"Its config.json does not describe {target} as it is here (edited, or written for another "
            f"version of it): restore that file, or retrain the drafter for {target}"
        )
        raise UsageError(
            f"the drafter at {path} was trained for target {cfg.target_name!r} (architecture "
            f"{cfg.target_fingerprint}, vocab {cfg.target_vocab_size}), but --target {target} has architecture "
            f"{arch['fingerprint']}, vocab {arch['vocab_size']}. {fix}."
        )


def check_prompt_text(prompt: str, raw: bool) -> None:
    """Refuse a ``--prompt`` that holds nothing to answer (empty; only spaces, through the chat template) or text
    that is not UTF-8 (bytes the shell passed undecoded, which no tokenizer takes)."""
    if not (prompt if raw else prompt.strip()):
        raise UsageError(
            "--prompt is empty: give the text to "
            + (
                'continue, e.g. --prompt "Once upon a time".'
                if raw
                else 'answer, e.g. --prompt "Why is the sky blue?".'
            )
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"--prompt is not UTF-8 text (undecodable bytes at character {e.start}): pass UTF-8, e.g. convert it "
            "with iconv -t UTF-8, or set the terminal's encoding to UTF-8."
        ) from None


def load_cli_drafter(spec: str, target: Target, seed: int) -> SessionFactory | None:
    """The drafter of ``spec`` for the loaded ``target``; what only the loaded target can refuse (a checkpoint
    of the same architecture with other weights, an early exit deeper than it) is a one-line error."""
    try:
        return resolve_drafter(spec, target, seed)
    except UsageError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--drafter {spec}: {e}") from None


def decode_config(args, mode: str) -> DecodeConfig:
    """The decoding settings of ``args``, validated; the counts a decode cannot run with are refused here."""
    if args.max_new_tokens < 1:
        raise UsageError(
            f"--max-new-tokens takes a number of tokens to generate (>= 1), got {args.max_new_tokens}."
        )
    if args.threads < 0:
        raise UsageError(
            f"--threads takes a number of torch threads (>= 1; 0 leaves torch's default), got {args.threads}."
        )
    try:
        return DecodeConfig(
            mode=mode,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            chain_depth=args.chain_depth,
            tree_depth=args.tree_depth,
            tree_top_k=args.tree_top_k,
            tree_budget=args.tree_budget,
            seed=args.seed,
        ).validate()
    except ValueError as e:
        raise UsageError(f"{e}") from None


def partial_config(args) -> SpecPVConfig | None:
    """The SpecPV settings of ``--verify partial``, validated (None for ``--verify full``)."""
    if args.verify != "partial":
        return None
    try:
        return SpecPVConfig(
            budget=args.budget,
            full_every=args.full_every,
            strict=args.strict,
            sink=args.sink,
            window=args.window,
            block_size=args.block_size,
            score=args.score,
        ).validate()
    except ValueError as e:
        raise UsageError(f"--verify partial: {e}") from None


def load_cli_target(args):
    import torch

    from ..target import TargetLoadError, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return load_target(args.target, device=args.device, dtype=args.dtype, seed=args.seed)
    except TargetLoadError as e:
        raise UsageError(f"{e}") from None


def _cli_generate(args) -> int:
    mode = args.mode or ("ar" if args.drafter == "none" else "chain")
    if mode == "ar" and args.drafter != "none":
        raise UsageError(
            f"--mode ar decodes without a drafter; drop --drafter {args.drafter} or use --mode chain / tree."
        )
    if mode != "ar" and args.drafter == "none":
        raise UsageError(f"--mode {mode} needs a drafter (--drafter ngram, self, or a checkpoint folder).")
    if args.mt_bench is not None and not 1 <= args.mt_bench <= 80:
        raise UsageError(f"--mt-bench takes a question number in 1..80, got {args.mt_bench}.")
    if args.verify == "full" and args.strict:
        raise UsageError("--strict re-checks partially verified tokens; it needs --verify partial.")
    if args.long_context is not None and args.long_context < 64:
        raise UsageError(f"--long-context takes a prompt length in tokens (>= 64), got {args.long_context}.")
    if mode == "ar" and (args.shape != "fixed" or args.lookup):
        raise UsageError("--shape chosen and --lookup shape a drafter's proposal; plain decoding has none.")
    cfg = decode_config(args, mode)
    partial = partial_config(args)
    if args.prompt is not None:
        check_prompt_text(args.prompt, args.raw)
    check_drafter_spec(args.drafter, args.target)
    target = load_cli_target(args)
    drafter = load_cli_drafter(args.drafter, target, args.seed)
    target, drafter = _in_precision(target, drafter, args.precision)
    if args.shape == "chosen" or args.lookup:
        from dataclasses import replace

        speed = None
        if args.shape == "chosen":
            from .cost_model import cost_model_for
            from .speed_model import SpeedModel

            speed = SpeedModel(cost_model_for(target, {args.drafter: drafter}), args.drafter)
        cfg = replace(cfg, shape=args.shape, lookup=args.lookup, speed=speed).validate()
    tok = target.tokenizer
    if args.mt_bench is not None:
        from ..corpus import chat_prompt_ids, load_mtbench, mtbench_messages

        prompt = chat_prompt_ids(tok, mtbench_messages(load_mtbench(args.mt_bench)[-1]))
    elif args.long_context is not None:
        from ..corpus import long_prompts

        try:  # a length the target's context cannot hold is refused with the longest it can
            prompt = long_prompts(tok, args.long_context, 1, max_context=target.info.max_context)[0].ids
        except ValueError as e:
            raise UsageError(f"--long-context {args.long_context}: {e}") from None
    elif args.raw:
        prompt = tok(args.prompt, add_special_tokens=False)["input_ids"]
    else:
        from ..corpus import chat_prompt_ids

        prompt = chat_prompt_ids(tok, [{"role": "user", "content": args.prompt}])
    if len(prompt) >= target.info.max_context:
        raise UsageError(
            f"the prompt has {len(prompt)} tokens, but {target.info.name}'s context holds {target.info.max_context} "
            f"(the prompt and every token generated): shorten the prompt below {target.info.max_context} tokens."
        )
    out = generate(target, prompt, cfg, drafter, partial=partial)
    # MAT as evaluation.metrics.mat_from_counts defines it (decoding sits below evaluation in the flow)
    mat = (sum(out.accepted_per_cycle) + out.n_cycles) / out.n_cycles if out.n_cycles else None
    text = tok.decode(out.token_ids, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                dict(
                    token_ids=out.token_ids,
                    text=text,
                    accepted_per_cycle=out.accepted_per_cycle,
                    tokens_per_s=out.tokens_per_s,
                    mat=mat,
                    n_cycles=out.n_cycles,
                    stop_reason=out.stop_reason,
                    prompt_len=out.prompt_len,
                    step_attempts=out.step_attempts,
                    step_accepts=out.step_accepts,
                    prefill_s=out.prefill_s,
                    draft_s=out.draft_s,
                    verify_s=out.verify_s,
                    total_s=out.total_s,
                    mode=mode,
                    drafter=args.drafter,
                    verify=args.verify,
                    **_partial_fields(out),
                )
            )
        )
    else:
        print(text)
        summary = f"[{len(out.token_ids)} tokens, {out.tokens_per_s:.1f} tokens/s"
        if hasattr(out, "n_partial"):
            summary += f", {out.n_partial} partial / {out.n_full} full passes, {len(out.rollbacks)} rollbacks"
        print(summary + (f", MAT {mat:.2f}]" if out.n_cycles else "]"), file=sys.stderr)
    return 0


def _in_precision(target: Target, drafter: SessionFactory | None, precision: str):
    """The target cast to ``precision`` (a copy unless it is in that dtype already) and the drafter bound to it."""
    from ..target import cast_target
    from .cost_model import decode_precision

    dtype = decode_precision(target, precision)  # auto: the faster of fp32 and bf16 here, as measured
    cast = cast_target(target, dtype)
    if cast is target:
        return target, drafter
    return cast, drafter_for_target(drafter, cast, dtype)


def _partial_fields(out) -> dict:
    if not hasattr(out, "cycle_kind"):
        return {}
    return dict(
        n_partial=out.n_partial,
        n_full=out.n_full,
        rollbacks=out.rollbacks,
        partial_s=out.partial_s,
        full_s=out.full_s,
        refresh_s=out.refresh_s,
        cycle_kind=out.cycle_kind,
    )
