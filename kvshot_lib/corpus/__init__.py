"""The corpus stage: ShareGPT (training) and MT-bench (evaluation) through the target's chat template, and the
feature store.

* :func:`tokenize_sharegpt` gives a cached, seeded :class:`TokenizedSplit` with assistant loss masks;
* :func:`load_mtbench` and :func:`mtbench_messages` give the 80 two-turn MT-bench prompts;
* :func:`long_prompts` gives real long prompts (the longest ShareGPT conversations, to summarize) of an
  exact token length, for long-context decoding (SpecPV);
* :func:`extract_features` runs the target once over a split and writes hidden states, K/V and soft-label
  features to resumable safetensors shards; :class:`FeatureStore` reads them lazily.

It hands token ids to decoding and evaluation, and feature stores to training.
"""

from .chat import answer_text, chat_prompt_ids, encode_conversation, render_masked, tokenizer_fingerprint
from .features import FeatureStore, FeatureStoreMismatch, default_store_dir, extract_features
from .long_context import LongPrompt, context_lengths, long_prompts
from .mtbench import MTBenchQuestion, load_mtbench, mtbench_messages
from .sharegpt import (
    TokenizedSplit,
    conversation_table,
    load_sharegpt,
    normalize_conversation,
    read_sharegpt_records,
    response_lengths,
    split_indices,
    tokenize_sharegpt,
)

__all__ = [
    "FeatureStore",
    "FeatureStoreMismatch",
    "LongPrompt",
    "MTBenchQuestion",
    "TokenizedSplit",
    "answer_text",
    "chat_prompt_ids",
    "context_lengths",
    "conversation_table",
    "default_store_dir",
    "encode_conversation",
    "extract_features",
    "load_mtbench",
    "load_sharegpt",
    "long_prompts",
    "mtbench_messages",
    "normalize_conversation",
    "read_sharegpt_records",
    "render_masked",
    "response_lengths",
    "split_indices",
    "tokenize_sharegpt",
    "tokenizer_fingerprint",
]
