"""Regenerated responses: batched greedy decoding, the cache, resuming, and what the split holds (tiny models)."""

import gzip
import json

import pytest
import torch

from kvshot_lib import corpus
from kvshot_lib.corpus import (
    batched_greedy,
    chat_prompt_ids,
    regenerate,
    regenerate_sharegpt,
    tokenize_sharegpt,
)
from kvshot_lib.decoding import DecodeConfig, autoregressive_generate
from kvshot_lib.target import REPO_ROOT


def test_batched_greedy_equals_plain_greedy(llama):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 3000, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
    plain = [
        autoregressive_generate(
            llama, p, DecodeConfig(mode="ar", max_new_tokens=12, stop_token_ids=())
        ).token_ids
        for p in prompts
    ]
    assert batched_greedy(llama, prompts, 12, stop=False) == plain
    stop = plain[1][4]  # a token that prompt 1's continuation reaches at its 5th step
    llama_stops = llama.info.eos_token_ids
    try:
        object.__setattr__(llama.info, "eos_token_ids", (stop,))
        cut = batched_greedy(llama, prompts, 12)
    finally:
        object.__setattr__(llama.info, "eos_token_ids", llama_stops)
    for got, ref in zip(cut, plain):
        end = ref.index(stop) + 1 if stop in ref else len(ref)
        assert got == ref[:end]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path))
    return tmp_path


def test_regeneration_keeps_user_turns_and_answers_greedily(tiny_llama, cache):
    split = regenerate_sharegpt(
        tiny_llama, "eval", 3, 256, max_new_tokens=6, max_turns=2, batch_size=2, progress=False
    )
    original = tokenize_sharegpt(tiny_llama.tokenizer, "eval", 3, 256)
    assert split.source_ids == original.source_ids and split.spec["responses"] == "regenerated"
    (folder,) = (cache / "regenerated").iterdir()
    records = [
        r for f in sorted(folder.glob("shard-*.json.gz")) for r in json.loads(gzip.decompress(f.read_bytes()))
    ]
    stops = set(tiny_llama.info.eos_token_ids)
    for rec in records:
        msgs = rec["messages"]
        assert [m["role"] for m in msgs if m["role"] != "system"][:2] == ["user", "assistant"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        prompt = chat_prompt_ids(tiny_llama.tokenizer, msgs[: first_user + 1])
        ref = autoregressive_generate(
            tiny_llama, prompt, DecodeConfig(mode="ar", max_new_tokens=6, stop_token_ids=())
        )
        ids = ref.token_ids
        cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        assert msgs[first_user + 1]["content"] == tiny_llama.tokenizer.decode(
            ids[:cut], skip_special_tokens=True
        )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["complete"] and manifest["generated_tokens"] > 0
    (shard,) = manifest["shards"]
    assert shard["engine"].startswith("suite") and shard["answers"] == sum(
        m["role"] == "assistant" for r in records for m in r["messages"]
    )
    assert shard["cut"] == shard["answers"]  # 6 new tokens: a random tiny model never stops that soon
    # the folder holds exactly the returned slice's conversations, so its training tokens are the slice's
    assert manifest["training_tokens"] == corpus.training_tokens(split, stops)
    assert manifest["training_tokens"]["tokens"] == split.n_tokens > 0


def test_regeneration_resumes_after_an_interruption(tiny_llama, cache, monkeypatch):
    kw = dict(max_new_tokens=4, max_turns=1, batch_size=2, shard_size=2, progress=False)
    real = regenerate.regenerate_conversations
    calls = []  # the conversation ids of each call

    def flaky(*args, **kwargs):
        calls.append([cid for cid, _ in args[1]])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "regenerate_conversations", flaky)
    with pytest.raises(KeyboardInterrupt):
        regenerate_sharegpt(tiny_llama, "eval", 5, 256, **kw)
    (folder,) = (cache / "regenerated").iterdir()
    first = (folder / "shard-00000.json.gz").read_bytes()
    assert not (folder / "shard-00001.json.gz").exists()
    kept = [r["id"] for r in json.loads(gzip.decompress(first))]
    assert kept == calls[0]  # the first shard holds the first call's conversations
    calls.clear()

    def recorded(*args, **kwargs):
        calls.append([cid for cid, _ in args[1]])
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "regenerate_conversations", recorded)
    resumed = regenerate_sharegpt(tiny_llama, "eval", 5, 256, **kw)
    # generation is deterministic, so a run that started over would write the same bytes: what shows that it
    # resumed is which conversations it regenerated (none of the finished shard's)
    assert calls and not set(kept) & {cid for call in calls for cid in call}
    assert (folder / "shard-00000.json.gz").read_bytes() == first  # finished shards are kept, not redone
    assert len(json.loads((folder / "manifest.json").read_text())["shards"]) == 3
    monkeypatch.setenv("KVSHOT_CACHE", str(cache / "fresh"))
    whole = regenerate_sharegpt(tiny_llama, "eval", 5, 256, **kw)
    assert [x.tolist() for x in resumed.ids] == [x.tolist() for x in whole.ids]


def test_partial_regeneration_is_a_prefix(tiny_llama, cache):
    split = regenerate_sharegpt(
        tiny_llama,
        "eval",
        4,
        256,
        max_new_tokens=4,
        batch_size=2,
        shard_size=2,
        max_seconds=0.0,
        progress=False,
    )
    original = tokenize_sharegpt(tiny_llama.tokenizer, "eval", 4, 256)
    assert split.counts["not_regenerated"] == 2  # one shard of two, then the cap
    assert split.source_ids == original.source_ids[:2]


def test_a_larger_slice_goes_on_from_a_smaller_ones_shards(tiny_llama, cache, monkeypatch):
    kw = dict(max_new_tokens=4, max_turns=1, batch_size=2, shard_size=2, progress=False)
    small = regenerate_sharegpt(tiny_llama, "eval", 2, 256, **kw)
    calls = []
    real = regenerate.regenerate_conversations

    def recorded(*args, **kwargs):
        calls.append([cid for cid, _ in args[1]])
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate, "regenerate_conversations", recorded)
    large = regenerate_sharegpt(tiny_llama, "eval", 4, 256, **kw)
    assert len(list((cache / "regenerated").iterdir())) == 1  # one folder for both sizes
    assert calls == [large.source_ids[2:]]  # only the two new conversations were answered
    assert [x.tolist() for x in large.ids[:2]] == [x.tolist() for x in small.ids]


def test_loops_finds_a_periodic_tail_only():
    assert regenerate.loops([5] * 30 + [1, 2, 3] * 40)  # period 3
    assert regenerate.loops(list(range(40)) + list(range(20)) * 5)  # period 20
    assert not regenerate.loops(list(range(200)))
    assert not regenerate.loops([1, 2, 3] * 20)  # shorter than the tail looked at
    assert not regenerate.loops(list(range(100)) * 2)  # period 100: longer than max_period


def test_an_unknown_engine_is_refused_before_any_work(tiny_llama, cache):
    with pytest.raises(ValueError, match="engine must be one of"):
        regenerate_sharegpt(tiny_llama, "eval", 2, 256, engine="hf", progress=False)


def test_a_conversation_whose_first_turn_does_not_fit_ends_there(tiny_llama):
    """Its second turn is not answered without the first (it would read a history that never was)."""
    long_first = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]
    convs = [("long", long_first + [{"role": "user", "content": "and now?"}])]
    short = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    convs.append(
        ("short", short + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "x"}])
    )
    records, counts = regenerate.regenerate_conversations(tiny_llama, convs, 3, 2, 64, 2)
    by_id = {r["id"]: r["messages"] for r in records}
    assert by_id["long"] == []
    assert [m["role"] for m in by_id["short"]] == ["user", "assistant", "user", "assistant"]
    assert counts["answers"] == 2


def test_looping_conversations_reads_each_answer_without_its_stop_token():
    stop, loop = 9, [1, 2, 3] * 40  # 120 tokens of period 3: loops() is True on it alone
    fresh = list(range(10, 210))  # no period: loops() is False

    def conversation(
        *answers,
    ):  # a user turn (2 tokens) before each answer, as the chat template lays them out
        ids, mask = [], []
        for a in answers:
            ids += [7, 8] + a
            mask += [False, False] + [True] * len(a)
        return torch.tensor(ids), torch.tensor(mask)

    convs = [
        conversation(loop + [stop]),  # the closing stop token would break the period if it were kept
        conversation(fresh + [stop]),
        conversation(fresh + [stop], loop + [stop]),  # the second answer loops
        conversation(loop),  # cut without a stop token (or by the length cap)
        conversation(loop + [4, stop]),  # one token off the period just before the stop: not a loop
    ]
    split = corpus.TokenizedSplit([c[0] for c in convs], [c[1] for c in convs], list("abcde"))
    assert regenerate.looping_conversations(split, [stop]) == [True, False, True, True, False]
    assert regenerate.looping_conversations(split, []) == [False, False, False, True, False]

    cut = corpus.cut_looping(split, [stop])
    # b: nothing loops, nothing moves; c: the second answer keeps one period and one repetition, then its stop
    assert torch.equal(cut.ids[1], split.ids[1]) and torch.equal(cut.loss_mask[1], split.loss_mask[1])
    assert cut.ids[2].tolist() == [7, 8] + fresh + [stop] + [7, 8] + [1, 2, 3, 1, 2, 3] + [stop]
    # the cut answer's stop token stays in the sequence, but is no target: the target did not stop there
    assert cut.loss_mask[2].tolist() == [False] * 2 + [True] * 201 + [False] * 2 + [True] * 6 + [False]
    assert cut.ids[3].tolist() == [7, 8, 1, 2, 3, 1, 2, 3]  # no stop token: the answer was cut by the cap
    assert torch.equal(cut.ids[4], split.ids[4])
    assert cut.counts["looping_answers_cut"] == 3 and cut.counts["looping_tokens_cut"] == 3 * 114
    assert not any(corpus.looping_conversations(cut, [stop]))
    # by hand: 123 + 203 + 326 + 122 + 124 tokens, of which 2 per user turn are not answers; each of the three cut
    # answers loses 114 tokens, and a and c their stop token's place in the loss mask
    assert corpus.training_tokens(split, [stop]) == dict(
        conversations=5, tokens=898, answer_tokens=886, tokens_loops_cut=898 - 3 * 114,
        answer_tokens_loops_cut=886 - 3 * 114 - 2, answers_cut=3,
    )  # fmt: skip


def test_loop_cut_keeps_the_text_before_the_loop_and_one_repetition():
    assert corpus.loop_cut([5] * 30 + [1, 2, 3] * 40) == 30 + 6  # the run starts after the 5s; period 3
    assert corpus.loop_period([5] * 30 + [1, 2, 3] * 40) == 3
    assert corpus.loop_cut(list(range(40)) + list(range(20)) * 5) == 40 + 40  # period 20, from index 40
    assert corpus.loop_cut(list(range(200))) == 200  # no loop: everything kept
    assert corpus.loop_cut([4] * 100) == 2  # period 1 from the start: one token and its repeat


def check_loop_stops(full: list[int], stopped: list[int]) -> bool:
    """``stopped`` is ``full`` ended at the first loop check (after every CHECK_EVERY tokens) that finds a loop, or
    all of ``full`` if none does; returns whether it was stopped."""
    every = corpus.looping.CHECK_EVERY
    first = next((t for t in range(every, len(full), every) if corpus.loops(full[:t])), None)
    assert stopped == (full if first is None else full[:first])
    return first is not None


def test_batched_greedy_stops_an_answer_once_it_loops(tiny_llama):
    """The plain tiny target repeats itself within a few tokens: answers loop, and each stops at the first check
    that sees it, a prefix of the answer that runs to the limit."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 3000, (n,), generator=g).tolist() for n in (5, 12, 20, 7)]
    full = batched_greedy(tiny_llama, prompts, 200)
    stopped = batched_greedy(tiny_llama, prompts, 200, stop_at_loop=True)
    assert sum(check_loop_stops(f, s) for f, s in zip(full, stopped)) >= 2


@pytest.mark.slow
@pytest.mark.skipif(not corpus.vllm_engine.serve_python(), reason="needs .venv-serve (make interop-env)")
def test_vllm_worker_stops_an_answer_once_it_loops():
    """vLLM CPU on SmolLM2, the committed held-out regeneration's looping answers: asked again with stop_at_loop,
    each ends at the first check that sees its loop, a prefix of the same answer run to the limit (batch 1 both
    times, so bf16 takes the same path), without the forced stop token."""
    from kvshot_lib.target import load_target

    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    folder = next(p for p in (REPO_ROOT / "data" / "regenerated").iterdir()
                  if json.loads((p / "manifest.json").read_text())["spec"]["split"] == "eval")  # fmt: skip
    records = json.loads(gzip.decompress((folder / "shard-00000.json.gz").read_bytes()))
    prompts = []
    for r in records:
        answer = target.tokenizer.encode(r["messages"][1]["content"], add_special_tokens=False)
        if corpus.loops(answer[:200]):  # looping early: the check costs 2 x 256 tokens per prompt
            prompts.append(chat_prompt_ids(target.tokenizer, r["messages"][:1]))
        if len(prompts) == 2:
            break
    with corpus.VllmGreedy(target) as engine:
        full = engine(prompts, 256, one_at_a_time=True)
        stopped = engine(prompts, 256, one_at_a_time=True, stop_at_loop=True)
    assert engine.last["loop_stopped"] >= 1
    assert sum(check_loop_stops(f, s) for f, s in zip(full, stopped)) == engine.last["loop_stopped"]
