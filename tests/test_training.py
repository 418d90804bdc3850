"""Training on tiny models: overfitting one batch, per-step accuracy, exact resume, parameter validation."""

import pytest
import torch

from kvshot_lib.corpus import extract_features, tokenize_sharegpt
from kvshot_lib.drafters import TargetView, build_drafter, drafter_config_for, load_drafter
from kvshot_lib.target import load_target
from kvshot_lib.training import (
    EvalSet,
    Objective,
    StoreBatches,
    TrainConfig,
    TrainConfigError,
    batch_from_target,
    evaluate_per_step,
    read_train_state,
    train_drafter,
)


@pytest.fixture(scope="module")
def peaky():
    """A tiny target with sharp next-token distributions (a random one is nearly uniform)."""
    t = load_target("tiny-llama", device="cpu", seed=0)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(
            40.0
        )  # tied with the embedding: only the logit scale changes after the norm
    return t


@pytest.fixture(scope="module")
def stores(tiny_llama, tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("features")
    train = tokenize_sharegpt(tokenizer, "train", 6, 48, seed=0)
    held = tokenize_sharegpt(tokenizer, "eval", 2, 48, seed=0)
    return extract_features(tiny_llama, train, out_dir=root / "train"), extract_features(
        tiny_llama, held, out_dir=root / "eval"
    )


def weighted_kl(parts, decay=0.8):
    return sum(decay**k * kl for k, kl in enumerate(parts["kl"]))


@pytest.mark.parametrize(
    "paradigm,regime",
    [("hidden", "ttt"), ("kv", "ttt"), ("hybrid", "ttt"), ("kv", "ttt_dense"), ("hidden", "tf")],
)
def test_overfits_one_batch(peaky, paradigm, regime):
    torch.manual_seed(0)
    ids = torch.randint(0, 2000, (24,))
    cfg = TrainConfig(
        paradigm=paradigm, regime=regime, ttt_steps=3, draft_vocab_size=256, kv_mode="linear_rope"
    )
    dcfg = drafter_config_for(peaky, paradigm, kv_mode="linear_rope", draft_vocab_size=256)
    d = build_drafter(dcfg, peaky, torch.randperm(2000)[:256].sort().values, seed=0)
    batch = batch_from_target(peaky, ids, torch.ones(24, dtype=torch.bool), dcfg)
    obj = Objective(d, cfg)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss, parts = obj(batch)
        first = weighted_kl(parts) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = weighted_kl(obj(batch)[1])
    assert first > 0.1  # the task is not trivial at the start
    assert last < 0.2 * first, (
        first,
        last,
    )  # the excess loss over the target's entropy falls by most of its value


def test_per_step_accuracy_matches_sessions(peaky):
    """evaluate_per_step = the share of steps whose draft argmax is the target's full-vocabulary argmax."""
    torch.manual_seed(1)
    T, K = 16, 3
    ids, lmask = torch.randint(0, 2000, (T,)), torch.rand(T) < 0.8
    with torch.no_grad():
        out = peaky.model(input_ids=ids[None], output_hidden_states=True)
    top = out.logits[0].argmax(-1)  # [T] the target's greedy token, full vocabulary
    d2t = torch.cat(
        [top[:10], torch.arange(40000, 40200)]
    ).unique()  # most, not all, target choices are draftable
    dcfg = drafter_config_for(peaky, "hybrid", draft_vocab_size=len(d2t))
    d = build_drafter(dcfg, peaky, d2t, seed=0)
    batch = batch_from_target(peaky, ids, lmask, dcfg)
    obj, opt = (
        Objective(d, TrainConfig(paradigm="hybrid", regime="ttt", ttt_steps=K)),
        torch.optim.Adam(d.parameters(), 3e-3),
    )
    for _ in range(40):  # a partly trained drafter, so that hits and misses both occur
        opt.zero_grad()
        obj(batch)[0].backward()
        opt.step()
    d.eval()
    got = evaluate_per_step(d, EvalSet([batch], [top[None]]), K)
    hits, counts = [0] * K, [0] * K
    for i in range(T - 1):
        P = i + 1
        cache = peaky.model(input_ids=ids[None, :P], use_cache=True).past_key_values
        s = d.new_session()
        logits = [
            s.start_cycle(
                ids[None, : P + 1], TargetView(cache, {j: out.hidden_states[j + 1][:, :P] for j in range(8)})
            )
        ]
        for k in range(1, K):
            if P + k < T:
                logits.append(s.expand(ids[P + k : P + k + 1], torch.tensor([k - 2]))[0])
        for k, lg in enumerate(logits):
            if P + 1 + k < T and lmask[P + 1 + k]:
                hits[k] += int(d.d2t[lg.argmax()] == top[P + k])
                counts[k] += 1
    for k in range(K):
        assert got[f"n_{k}"] == counts[k]
        assert got[f"acc_{k}"] == pytest.approx(hits[k] / counts[k])
    assert 0 < sum(hits) < sum(counts)
    assert got["ceiling"] == pytest.approx(float(torch.isin(top[1:-1][lmask[2:]], d2t).float().mean()))


PARAMS = dict(
    paradigm="hybrid",
    regime="ttt",
    ttt_steps=3,
    train_steps=6,
    batch_size=2,
    draft_vocab_size=512,
    eval_every=3,
    eval_sequences=2,
    eval_steps=3,
    probe_every=2,
    save_every=3,
    branch_fraction=0.5,
)


def test_resume_is_exact_and_finished_runs_return_from_disk(tiny_llama, stores, tmp_path, monkeypatch):
    train, held = stores
    full = train_drafter(tiny_llama, train, held, PARAMS, tmp_path / "full", progress=False)
    real_batch = StoreBatches.batch

    def interrupted(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real_batch(self, step)

    monkeypatch.setattr(StoreBatches, "batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_llama, train, held, PARAMS, tmp_path / "cut", progress=False)
    assert (tmp_path / "cut" / "state" / "trainer.json").is_file() and not (
        tmp_path / "cut" / "config.json"
    ).exists()
    assert read_train_state(tmp_path / "cut")["step"] == 3  # save_every=3: the state after step 3
    seen = []

    def recorded(self, step):
        seen.append(step)
        return real_batch(self, step)

    monkeypatch.setattr(StoreBatches, "batch", recorded)
    resumed = train_drafter(tiny_llama, train, held, PARAMS, tmp_path / "cut", progress=False)
    # batches, branches and initialization are functions of the step: a "resume" that started over would
    # give the same weights, so the steps the resumed call ran are what shows that it resumed
    assert seen == [3, 4, 5]
    a, b = full.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in full.logs["history"]] == [r["loss"] for r in resumed.logs["history"]]
    assert not (tmp_path / "cut" / "state").exists()
    # a finished run is returned from disk without training
    monkeypatch.setattr(StoreBatches, "batch", interrupted)
    again = train_drafter(tiny_llama, train, held, PARAMS, tmp_path / "full", progress=False)
    assert torch.equal(again.drafter.state_dict()["fc.weight"], a["fc.weight"])
    assert len(again.table("grad_probes")) == len(full.table("grad_probes")) > 0
    loaded = load_drafter(tmp_path / "full", tiny_llama)
    assert loaded.regime == "ttt" and loaded.cfg.extra["completed"] and loaded.cfg.extra["train_tokens"] > 0
    ev = full.table("eval")
    assert list(ev["step"]) == [1, 3, 6] and {"acc_0", "acc_2", "ceiling", "gate_mean"} <= set(ev.columns)


def test_store_without_the_needed_layers_is_refused(tiny_llama, tokenizer, tmp_path):
    split = tokenize_sharegpt(tokenizer, "eval", 2, 32, seed=0)
    store = extract_features(tiny_llama, split, hidden_layers=[1], kv_layers=[1], out_dir=tmp_path / "s")
    with pytest.raises(ValueError, match="does not fit drafter 'hidden-ttt'.*missing hidden \\[3, 4\\]"):
        train_drafter(tiny_llama, store, store, dict(paradigm="hidden", regime="ttt"), tmp_path / "x")


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(paradigm="kv", regime="ttt", lr="fast"), "lr must be float"),
        (dict(paradigm="kv", regime="ttt", n_layer=2), "unknown parameters \\['n_layer'\\]"),
        (dict(paradigm="kv", regime="dpo"), "regime must be one of"),
        (dict(paradigm="psychic", regime="ttt"), "paradigm must be one of"),
        (dict(paradigm="kv", regime="ttt", n_layers=5), "n_layers must be in 1..4"),
        (dict(paradigm="kv", regime="ttt", grad_scale={"kv": 50}), "unknown parameter groups \\['kv'\\]"),
        (dict(paradigm="kv", regime="ttt", branch_fraction=0), "branch_fraction must be in"),
        (dict(paradigm="hidden", regime="ttt", answer_start_weight=0.0), "answer_start_weight=0.0"),
        (dict(paradigm="hidden", regime="ttt", answer_start_tokens=0), "answer_start_tokens=0"),
        (dict(regime="ttt"), "missing 'paradigm'"),
    ],
)
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig.from_params(params)


def test_regime_defaults():
    assert TrainConfig.from_params(dict(paradigm="hidden", regime="ttt")).step_decay == 0.8
    block = TrainConfig.from_params(dict(paradigm="hybrid", regime="ttt_dense"))
    assert block.kv_align_weight == 1.0 and block.feature_loss_weight == 1.0 and block.n_train_steps == 7
    assert TrainConfig.from_params(dict(paradigm="kv", regime="tf")).n_train_steps == 1
