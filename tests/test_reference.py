"""The reference run's training path, on tiny targets and the CPU.

* Online training (the target inside the loop) gives the losses and held-out accuracies of training from a
  float32 feature store of the same split, step by step, to float tolerance.
* Early stopping on held-out acceptance, the plateau measure and ``init_from``.
"""

from types import SimpleNamespace

import pytest
import torch

from kvshot_lib.corpus import extract_features, tokenize_sharegpt
from kvshot_lib.drafters import build_drafter, count_tokens, drafter_config_for, load_drafter
from kvshot_lib.reference import kv_ablation
from kvshot_lib.target import load_target
from kvshot_lib.training import (
    EarlyStopping,
    OnlineBatches,
    StoreBatches,
    TrainConfig,
    TrainConfigError,
    build_draft_vocab,
    evaluate_per_step,
    heldout_acceptance,
    online_eval_set,
    plateau,
    train_drafter,
)

SHARED = dict(
    regime="ttt",
    ttt_steps=3,
    train_steps=4,
    batch_size=2,
    max_tokens=96,  # crops the 128-token conversations (every cropped one keeps assistant tokens)
    draft_vocab_size=256,
    eval_every=2,
    eval_sequences=2,
    probe_every=0,
    lr=3e-3,
    warmup_steps=1,
)


@pytest.fixture(scope="module")
def peaky():
    """A tiny target with sharp next-token distributions, so that the soft labels matter (as in test_training)."""
    t = load_target("tiny-llama", device="cpu", seed=0)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(4.0)  # tied with the embedding: x40 makes every drafter copy its input
    return t


@pytest.fixture(scope="module")
def splits(tokenizer):
    return tokenize_sharegpt(tokenizer, "train", 5, 128, seed=0), tokenize_sharegpt(
        tokenizer, "eval", 2, 128, seed=0
    )


@pytest.fixture(scope="module")
def stores(peaky, splits, tmp_path_factory):
    root = tmp_path_factory.mktemp("f32")
    train, held = splits
    return (
        extract_features(peaky, train, out_dir=root / "train", dtype="float32", precision="no"),
        extract_features(peaky, held, out_dir=root / "eval", dtype="float32", precision="no"),
    )


def test_online_batches_equal_store_batches(peaky, splits, stores):
    cfg = drafter_config_for(peaky, "hybrid", draft_vocab_size=256)
    online = OnlineBatches(peaky, splits[0], cfg, batch_size=2, seed=3, max_tokens=96)
    store = StoreBatches(stores[0], cfg, batch_size=2, seed=3, max_tokens=96)
    for step in (0, 1, 4):  # step 4 is in the second epoch
        assert online.items(step) == store.items(step)
        a, b = online.batch(step), store.batch(step)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.lengths, b.lengths)
        for name in ("final_hidden", "hidden", "keys", "values"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)


def test_online_batches_run_the_target_under_the_runs_autocast(peaky, splits, tmp_path, amx_cpu):
    """Online, the target runs under the run's autocast, as the extraction does: its batches are a bf16-extracted
    store's (stored in float32 here), not a float32 one's."""
    cfg = drafter_config_for(peaky, "hybrid", draft_vocab_size=256)
    bf16 = extract_features(peaky, splits[0], out_dir=tmp_path / "bf16", dtype="float32", precision="bf16")
    fp32 = extract_features(peaky, splits[0], out_dir=tmp_path / "fp32", dtype="float32", precision="no")
    online = OnlineBatches(peaky, splits[0], cfg, batch_size=2, seed=3, max_tokens=96, precision="bf16")
    a, b, c = (
        src.batch(1)
        for src in (
            online,
            *(StoreBatches(s, cfg, batch_size=2, seed=3, max_tokens=96) for s in (bf16, fp32)),
        )
    )
    for name in ("final_hidden", "hidden", "keys", "values"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(getattr(a, name), getattr(c, name), atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("paradigm", ["hybrid", "kv"])
def test_online_training_has_the_store_losses(peaky, splits, stores, tmp_path, paradigm):
    assert torch.equal(count_tokens(splits[0], 49152), count_tokens(stores[0], 49152))
    d2t = build_draft_vocab(splits[0], peaky, 256)
    assert torch.equal(d2t, build_draft_vocab(stores[0], peaky, 256))
    runs = {}
    for source, (train, held) in (("store", stores), ("online", splits)):
        cfg = TrainConfig(
            paradigm=paradigm, data_source=source, mixed_precision="no", **SHARED
        )  # as the stores
        runs[source] = train_drafter(peaky, train, held, cfg, tmp_path / source, d2t=d2t, progress=False)
    a, b = runs["store"].logs, runs["online"].logs
    assert [r["tokens"] for r in a["history"]] == [r["tokens"] for r in b["history"]]
    assert all(r["loss"] > 0.1 for r in a["history"])  # every step has assistant tokens to learn
    for ra, rb in zip(a["history"], b["history"]):
        for key in ("loss", "ce_0", "ce_2"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
    for ea, eb in zip(a["eval"], b["eval"]):
        for key in ("acc_0", "acc_2", "ce_0", "ceiling"):
            assert eb[key] == pytest.approx(ea[key], rel=1e-4, abs=1e-5), (ea["step"], key)
    # the held-out KV ablation of an online row computes the held-out features: the store row's numbers
    ablations = {
        source: kv_ablation(runs[source], peaky, held).set_index(["condition", "draft_step"])
        for source, (_, held) in (("store", stores), ("online", splits))
    }
    assert set(ablations["online"].index.get_level_values(0)) == {"real", "zeroed", "shuffled"}
    for key, row in ablations["store"].iterrows():
        assert ablations["online"].loc[key, "accuracy"] == pytest.approx(row["accuracy"], abs=1e-9), key
        assert ablations["online"].loc[key, "n"] == row["n"] > 0, key
    assert "online" in load_drafter(tmp_path / "online", peaky).cfg.extra["train_store"]
    extra = load_drafter(tmp_path / "store", peaky).cfg.extra  # a store by its folder's name, never a path
    assert (extra["train_store"], extra["eval_store"]) == ("train", "eval")


def test_wrong_data_kind_is_refused_before_training(peaky, splits, stores, tmp_path):
    with pytest.raises(TypeError, match="TokenizedSplit"):
        train_drafter(
            peaky, *stores, TrainConfig(paradigm="hidden", data_source="online", **SHARED), tmp_path
        )
    with pytest.raises(TypeError, match="FeatureStore"):
        train_drafter(peaky, *splits, TrainConfig(paradigm="hidden", **SHARED), tmp_path)
    with pytest.raises(TrainConfigError, match="data_source"):
        TrainConfig.from_params(dict(paradigm="hidden", regime="ttt", data_source="disk"))
    with pytest.raises(TrainConfigError, match="target_kv"):
        TrainConfig.from_params(dict(paradigm="none", regime="ttt", target_kv="zeroed"))


def evals(*acc0, acc1=0.5):
    return [dict(step=10 * (i + 1), acc_0=a, acc_1=acc1) for i, a in enumerate(acc0)]


def test_heldout_acceptance_is_the_mat_formula():
    ev = dict(acc_0=0.5, acc_1=0.4, acc_2=0.25, ce_0=1.0, n_0=3)
    assert heldout_acceptance(ev) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.25)
    assert heldout_acceptance(ev, "acc_0") == 0.5


def test_early_stopping_counts_evaluations_without_gain():
    stop = EarlyStopping(patience=2, metric="acc_0")
    decisions = [stop.update(r["step"], r) for r in evals(0.2, 0.3, 0.29, 0.31, 0.30, 0.30)]
    assert decisions == [False, False, False, False, False, True]
    assert stop.best_step == 40 and stop.best_value == 0.31
    off = EarlyStopping(patience=0)
    assert not any(off.update(r["step"], r) for r in evals(0.5, 0.4, 0.3, 0.2))


def test_plateau_compares_the_last_fifth():
    moving = plateau(evals(0.1, 0.2, 0.3, 0.4, 0.5))  # steps 10..50: 80% of 50 is 40 -> 0.4 vs 0.5
    assert moving["plateau_from_step"] == 40 and moving["plateau_delta"] == pytest.approx(0.1)
    assert moving["plateaued"] is False
    flat = plateau(evals(0.1, 0.3, 0.40, 0.405, 0.409))
    assert flat["plateaued"] is True and flat["plateau_delta"] == pytest.approx(0.004)
    assert plateau(evals(0.3))["plateaued"] is None  # one evaluation cannot tell


def test_a_run_trained_to_a_plateau_is_judged_on_its_stable_phase():
    """The annealed final evaluation jumps by the decay; the plateau a row reports is the rule's, before it."""

    from kvshot_lib.training import stable_plateau

    cfg = SimpleNamespace(plateau_stop=0.01, plateau_min_steps=0, train_steps=100, decay_fraction=0.1)
    ruled = evals(0.15, 0.19, 0.205, 0.21) + [dict(step=44, acc_0=0.24)]  # rule at 40, decay to 44
    got = stable_plateau(cfg, ruled)
    assert got["decay_from"] == 40 and got["plateaued"] is True
    assert (got["plateau_from_step"], got["plateau_to_step"]) == (30, 40)
    assert got["plateau_delta"] == pytest.approx(0.005)
    assert plateau(ruled)["plateaued"] is False  # over every evaluation, the decay's jump would count
    capped = evals(*[0.1 + 0.02 * i for i in range(10)])  # steps 10..100, still climbing at the cap
    got = stable_plateau(cfg, capped)
    assert got["decay_from"] is None and got["plateau_to_step"] == 90  # the planned decay starts at 90
    assert got["plateau_from_step"] == 60 and got["plateau_delta"] == pytest.approx(0.06)


def test_the_plateau_rule_waits_for_its_first_step():
    """An early lull (steps 30-40 move 0.004) fires the rule at once; with ``plateau_min_steps`` it waits, and fires
    at the first evaluation from there whose last quarter moved under the tolerance: step 100 (0.580 -> 0.585)."""

    from kvshot_lib.training import plateau_step, stable_plateau

    log = evals(0.10, 0.20, 0.300, 0.304, 0.40, 0.50, 0.58, 0.582, 0.584, 0.585)  # steps 10..100
    assert plateau_step(log, 0.01) == 40
    assert plateau_step(log, 0.01, min_step=41) == plateau_step(log, 0.01, min_step=100) == 100
    assert plateau_step(log, 0.01, min_step=101) is None
    cfg = SimpleNamespace(plateau_stop=0.01, plateau_min_steps=50, train_steps=200, decay_fraction=0.1)
    assert stable_plateau(cfg, log)["decay_from"] == 100
    with pytest.raises(TrainConfigError, match="only with plateau_stop"):
        TrainConfig("hidden", "ttt", plateau_min_steps=50)
    # a saved config of before the key matches a config at its default; a set key is saved and read back
    assert "plateau_min_steps" not in TrainConfig("hidden", "ttt").as_dict()
    waits = TrainConfig(
        "hidden", "ttt", schedule="wsd", eval_every=10, plateau_stop=0.01, plateau_min_steps=50
    )
    assert waits.as_dict()["plateau_min_steps"] == 50
    assert TrainConfig.from_params(waits.as_dict()) == waits


def test_early_stopping_restores_the_best_drafter(peaky, splits, tmp_path):
    """The checkpoint is the best drafter: loaded back from disk and evaluated again on the held-out set, it
    has the best evaluation's accuracies (the loop's last eval row is a copy of the best one, so checking
    that row alone would prove nothing)."""
    cfg = TrainConfig(
        paradigm="hidden",
        data_source="online",
        **dict(SHARED, train_steps=12, eval_every=1, lr=0.03, early_stop_patience=2),  # lr 0.03 overshoots
        mixed_precision="no",  # the reloaded checkpoint is re-evaluated below in float32
    )
    result = train_drafter(peaky, *splits, cfg, tmp_path / "es", progress=False)
    extra = result.drafter.cfg.extra
    raw = [e for e in result.logs["eval"] if "restored_from_step" not in e]
    best = max(raw, key=heldout_acceptance)
    assert extra["best_step"] == best["step"]
    # the premises: the run stopped early, and its last weights were worse than the best ones
    assert extra["stopped_early"] and len(result.logs["history"]) < 12 and "no better" in extra["stop_reason"]
    assert heldout_acceptance(raw[-1]) < heldout_acceptance(best)
    loaded = load_drafter(tmp_path / "es", peaky).eval()
    evals = online_eval_set(splits[1], loaded.cfg, peaky, cfg.eval_sequences, cfg.batch_size, cfg.max_tokens)
    again = evaluate_per_step(loaded, evals, cfg.eval_steps)
    for k in range(cfg.eval_steps):
        assert again[f"acc_{k}"] == pytest.approx(best[f"acc_{k}"], abs=1e-9), k
        assert again[f"ce_{k}"] == pytest.approx(best[f"ce_{k}"], rel=1e-5), k
    assert heldout_acceptance(again) == pytest.approx(heldout_acceptance(best))


def test_init_from_copies_the_shared_parameters(tiny_llama, splits, tmp_path):
    d2t = build_draft_vocab(splits[0], tiny_llama, 256)
    hidden = train_drafter(
        tiny_llama,
        *splits,
        TrainConfig(paradigm="hidden", data_source="online", **SHARED),
        tmp_path / "h",
        d2t=d2t,
    )
    cfg = TrainConfig(
        paradigm="hybrid", data_source="online", init_from=str(tmp_path / "h"), **dict(SHARED, train_steps=1)
    )
    fresh = build_drafter(
        drafter_config_for(tiny_llama, "hybrid", draft_vocab_size=256), tiny_llama, d2t, seed=0
    )
    from kvshot_lib.training import new_drafter

    started = new_drafter(tiny_llama, *splits, cfg, d2t)
    info = started.cfg.extra["init_from"]
    src = hidden.drafter.state_dict()
    for name in info["copied"]:
        assert torch.equal(started.state_dict()[name], src[name]), name
    assert "fc.weight" in info["copied"] and "layers.0.self_attn.q_proj.weight" in info["copied"]
    assert any("cross_attn" in n for n in info["kept"]) and any("gate" in n for n in info["kept"])
    for name in info["kept"]:  # the hybrid-only parameters keep the fresh initialization
        assert torch.equal(started.state_dict()[name], fresh.state_dict()[name]), name
    wrong = torch.arange(256) * 7  # another draft vocabulary of the same size
    with pytest.raises(ValueError, match="draft vocabulary"):
        new_drafter(tiny_llama, *splits, cfg, wrong)
