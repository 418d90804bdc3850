"""The feature store holds exactly what the target computes, resumes after interruption and refuses mismatches."""

import json

import pytest
import torch

from kvshot_lib import corpus
from kvshot_lib.corpus import FeatureStore, FeatureStoreMismatch, extract_features, features


@pytest.fixture(scope="module")
def split(tokenizer):
    return corpus.tokenize_sharegpt(tokenizer, "train", 6, max_len=96, seed=0)


def test_store_holds_what_the_target_computes(tiny_llama, split, tmp_path):
    store = extract_features(
        tiny_llama,
        split,
        hidden_layers=[1, 3],
        kv_layers=[4],
        out_dir=tmp_path,
        dtype="float32",
        shard_tokens=200,
        precision="no",  # the target's float32 forward, compared exactly below
    )
    assert len(store) == len(split) and store.n_tokens == split.n_tokens
    assert len(store.manifest["shards"]) > 1  # the plan really splits into shards
    model = tiny_llama.model
    for i in (0, len(split) - 1):
        seq = store.sequence(i)
        ids = split.ids[i]
        out = model(ids[None], output_hidden_states=True, use_cache=True)
        assert torch.equal(seq["input_ids"].long(), ids) and torch.equal(
            seq["loss_mask"].bool(), split.loss_mask[i]
        )
        for layer in (1, 3):
            torch.testing.assert_close(
                seq[f"hidden.{layer}"], out.hidden_states[layer + 1][0], atol=1e-5, rtol=0
            )
        cache = out.past_key_values.layers[4]
        torch.testing.assert_close(seq["keys.4"], cache.keys[0].transpose(0, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(seq["values.4"], cache.values[0].transpose(0, 1), atol=1e-5, rtol=0)
        # the soft labels: the target's next-token distribution is lm_head(final_hidden)
        torch.testing.assert_close(model.lm_head(seq["final_hidden"]), out.logits[0], atol=1e-4, rtol=0)
    m = store.manifest
    assert m["target_fingerprint"] == tiny_llama.info.fingerprint and m["hidden_layers"] == [1, 3]
    assert m["bytes_per_token"] == pytest.approx(sum(s["bytes"] for s in m["shards"]) / split.n_tokens)
    # float32 rows: 4 bytes x (2 hidden + final hidden + K + V) per token, plus ids/mask, plus headers
    per_token = 4 * (3 * 64 + 2 * 2 * 16) + 4 + 1
    assert per_token <= m["bytes_per_token"] < per_token * 1.2


def test_extraction_resumes_after_interruption(tiny_llama, split, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = features._extract_sequence

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "_extract_sequence", flaky)
    with pytest.raises(KeyboardInterrupt):
        extract_features(tiny_llama, split, out_dir=tmp_path / "a", shard_tokens=150)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert not manifest["complete"] and len(manifest["shards"]) >= 1
    kept = {s["file"]: (tmp_path / "a" / s["file"]).stat().st_mtime_ns for s in manifest["shards"]}
    calls["n"] = -1000  # no more interruptions
    resumed = extract_features(tiny_llama, split, out_dir=tmp_path / "a", shard_tokens=150)
    for f, mtime in kept.items():
        assert (tmp_path / "a" / f).stat().st_mtime_ns == mtime  # finished shards were kept, not redone
    fresh = extract_features(tiny_llama, split, out_dir=tmp_path / "b", shard_tokens=150)
    assert resumed.manifest["content_hash"] == fresh.manifest["content_hash"]


def test_corrupted_shard_is_redone(tiny_llama, split, tmp_path, monkeypatch):
    """The corrupt shard is extracted again (its sequences, and only those, go through the target) and the
    file on disk is good again: the manifest's hashes are the recorded ones, so comparing them alone would
    not see a corrupt shard left in place."""
    store = extract_features(tiny_llama, split, out_dir=tmp_path, shard_tokens=150)
    shard = store.manifest["shards"][0]
    first = tmp_path / shard["file"]
    good = first.read_bytes()
    first.write_bytes(good[:-10] + b"0123456789")
    extracted = []
    real = features._extract_sequence

    def recorded(target, ids, *args):
        extracted.append(ids.tolist())
        return real(target, ids, *args)

    monkeypatch.setattr(features, "_extract_sequence", recorded)
    again = extract_features(tiny_llama, split, out_dir=tmp_path, shard_tokens=150)
    start, end = shard["sequences"]
    assert extracted == [x.tolist() for x in split.ids[start:end]], "only the corrupt shard is redone"
    assert first.read_bytes() == good and features._sha256(first) == shard["sha256"]
    assert again.manifest["content_hash"] == store.manifest["content_hash"]


def test_mismatched_store_is_refused(tiny_llama, tiny_qwen3, split, tmp_path):
    store = extract_features(tiny_llama, split, hidden_layers=[1], kv_layers=[2], out_dir=tmp_path)
    with pytest.raises(FeatureStoreMismatch, match="hidden_layers"):
        extract_features(tiny_llama, split, hidden_layers=[3], kv_layers=[2], out_dir=tmp_path)
    with pytest.raises(FeatureStoreMismatch, match="target"):
        extract_features(tiny_qwen3, split, hidden_layers=[1], kv_layers=[2], out_dir=tmp_path)
    with pytest.raises(FeatureStoreMismatch, match="extracted from target"):
        store.check_compatible("tiny-qwen3", tiny_qwen3.info.fingerprint)
    with pytest.raises(FeatureStoreMismatch, match="missing hidden"):
        store.check_compatible("tiny-llama", tiny_llama.info.fingerprint, hidden_layers=[1, 3])
    store.check_compatible("tiny-llama", tiny_llama.info.fingerprint, hidden_layers=[1], kv_layers=[2])


def test_bad_layers_and_missing_store_are_clear_errors(tiny_llama, split, tmp_path):
    with pytest.raises(ValueError, match="layers"):
        extract_features(
            tiny_llama, split, hidden_layers=[7], out_dir=tmp_path
        )  # the last layer is post-norm
    with pytest.raises(FileNotFoundError, match="extract_features"):
        FeatureStore(tmp_path / "nothing")


def test_a_finished_store_is_only_read(tiny_llama, split, tmp_path, monkeypatch):
    """Reopening a complete store extracts nothing and writes nothing (its manifest keeps the machine that
    extracted it), so two training runs can open one store at once; a stray ``.tmp`` of another run stays."""
    store = extract_features(tiny_llama, split, out_dir=tmp_path, shard_tokens=150)
    manifest = tmp_path / "manifest.json"
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    (tmp_path / "manifest.json.tmp").write_text("another run's")

    def refuse(*args, **kwargs):
        raise AssertionError("a finished store went through the target again")

    monkeypatch.setattr(features, "_extract_sequence", refuse)
    monkeypatch.setattr(features, "machine_record", lambda *a: dict(cpu="another machine"))
    again = extract_features(tiny_llama, split, out_dir=tmp_path, shard_tokens=150)
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before
    assert (tmp_path / "manifest.json.tmp").read_text() == "another run's"
    assert again.manifest["content_hash"] == store.manifest["content_hash"]


def test_a_subset_of_a_store_reads_the_chosen_sequences_in_order(tiny_llama, split, tmp_path):
    store = extract_features(
        tiny_llama, split, hidden_layers=[1], out_dir=tmp_path, dtype="float32", shard_tokens=200
    )
    view = store.subset([4, 0])
    assert len(view) == 2 and len(store) == len(split)  # the store itself is unchanged
    for j, i in enumerate([4, 0]):
        a, b = view.sequence(j), store.sequence(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert view.n_tokens == len(split.ids[4]) + len(split.ids[0]) == view.manifest["n_tokens"]
    assert (
        view.manifest["content_hash"] != store.manifest["content_hash"]
    )  # caches keyed on it never mix the two
    assert store.n_tokens == store.manifest["n_tokens"] == split.n_tokens
    part = split.subset([4, 0])
    assert part.source_ids == [split.source_ids[4], split.source_ids[0]] and part.n_tokens == view.n_tokens


def test_two_subsets_of_one_size_never_share_a_store_folder(tiny_llama, split):
    """A folder is keyed by the split's spec: two subsets of two conversations each must differ in it (they once
    collided, and only the manifest's shard plan stopped the second from reading the first's features)."""
    a, b = split.subset([4, 0]), split.subset([1, 2])
    folder = lambda part: features.default_store_dir(tiny_llama, part, [1], [1], "float32")  # noqa: E731
    assert a.spec != b.spec and folder(a) != folder(b)
    assert folder(a) == folder(split.subset([4, 0]))  # and the same subset finds its own folder again


def test_a_row_that_keeps_some_conversations_reads_the_whole_store_only_where_it_is_finished(
    tiny_llama, split, tmp_path, monkeypatch
):
    """``reference.data.row_store``: with no store of the slice, only the kept conversations are extracted (and the
    slice's own store is not started); once the slice's store is finished, the row reads a view of it instead."""
    from kvshot_lib.reference import data

    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path))
    keep = [4, 0, 2]
    assert extract_features(tiny_llama, split, precision="no", extract=False) is None
    own = data.row_store(tiny_llama, split, keep, "no")
    assert len(own) == 3 and own.n_tokens == split.subset(keep).n_tokens
    assert (
        extract_features(tiny_llama, split, precision="no", extract=False) is None
    )  # nothing of the slice written
    whole = extract_features(tiny_llama, split, precision="no")
    view = data.row_store(tiny_llama, split, keep, "no")
    assert view.path == whole.path != own.path and len(view) == 3
    for j, i in enumerate(keep):
        a, b = view.sequence(j), own.sequence(j)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i
