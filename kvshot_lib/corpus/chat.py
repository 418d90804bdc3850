"""The target's chat template: conversations to token ids with an assistant mask, and back to text.

The assistant mask covers each assistant turn's content and its end-of-turn token (not the
``<|im_start|>assistant`` header), found by locating the rendered contents in the text and mapping character
spans to tokens through the fast tokenizer's offsets, so it works for any template that copies contents
verbatim.
"""

from __future__ import annotations

import hashlib
import json


def encode_conversation(
    tokenizer, messages: list[dict], max_len: int | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, and the assistant mask.

    Raises ``ValueError`` if a message's content does not appear verbatim in the rendering.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    eot = tokenizer.eos_token or ""
    spans, cursor = [], 0
    for m in messages:
        content = m["content"]
        at = text.find(content, cursor)
        if at < 0:
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            raise ValueError("chat template does not copy the message content verbatim")
        end = at + len(content)
        if m["role"] == "assistant":
            if eot and text.startswith(eot, end):
                end += len(eot)
            spans.append((at, end))
        cursor = end
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, j = [], 0
    for s, e in offsets:
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        mask.append(j < len(spans) and s < spans[j][1] and e > spans[j][0])
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a prompt that ends with the assistant header, ready for generation."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenizer_fingerprint(tokenizer) -> str:
    blob = json.dumps(
        [
            len(tokenizer),
            tokenizer.chat_template,
            tokenizer.eos_token,
            tokenizer.convert_ids_to_tokens(list(range(0, len(tokenizer), 997))),
        ]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def answer_text(tokenizer, ids: list[int], stops) -> str:
    """The text of a generated answer up to its first stop token: what a second MT-bench turn is shown."""
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:cut], skip_special_tokens=True)


def render_masked(tokenizer, ids, mask, open_mark: str = "⟦", close_mark: str = "⟧") -> str:
    """Decode ``ids`` with the assistant-masked (trained-on) spans wrapped in ``⟦ … ⟧``."""
    ids, mask = list(map(int, ids)), list(map(bool, mask))
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tokenizer.decode(ids[i:j])
        out.append(f"{open_mark}{text}{close_mark}" if mask[i] else text)
        i = j
    return "".join(out)
