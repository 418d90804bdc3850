"""Precision follows the hardware: ``auto`` on a CPU without bf16, measured where bf16 is native, bf16 refused
where it is not before any work, bf16 training against float32 (one step's gradients, a 50-step loss curve),
bf16 feature stores."""

import json

import pytest
import torch

from kvshot_lib.corpus import FeatureStore, extract_features, tokenize_sharegpt
from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.target import PrecisionError, load_target, resolve_precision
from kvshot_lib.target import precision as precision_module
from kvshot_lib.training import Objective, TrainConfig, batch_from_target, train_drafter

PARADIGMS = ["hidden", "kv", "hybrid", "none", "cross"]


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    """A CPU whose flags list neither AMX-BF16 nor AVX512-BF16 (plain AVX2)."""
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))


def test_auto_picks_bf16_only_where_the_cpu_has_it(no_bf16_cpu, monkeypatch):
    monkeypatch.setattr(precision_module, "time_train_probe", None)  # nothing is timed: calling it would fail
    assert resolve_precision("auto", "cpu") == "no"
    assert resolve_precision("no", "cpu") == "no"
    with pytest.raises(PrecisionError, match="neither AMX-BF16 nor AVX512-BF16"):
        resolve_precision("bf16", "cpu")
    with pytest.raises(PrecisionError, match="CUDA only"):
        resolve_precision("fp16", "cpu")


def test_auto_on_an_amx_cpu_is_measured_not_read_from_the_flags(amx_cpu, tmp_path, monkeypatch):
    """The flags allow bf16; the cached probe decides (both outcomes: tests/test_precision_choice.py)."""
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path))
    monkeypatch.setattr(precision_module, "_CHOSEN", {})
    probes = {precision_module.train_probe_key(p, "cpu"): s for p, s in (("fp32", 0.05), ("bf16", 0.08))}
    (tmp_path / "precision_probes.json").write_text(json.dumps(probes))
    assert resolve_precision("auto", "cpu") == "no"  # bf16 measured slower
    assert precision_module.bf16_isa() == "amx_bf16 amx_tile avx512_bf16"


def test_machine_labels_tell_cpus_of_one_model_apart_by_their_bf16_path(monkeypatch):
    """Two AMD EPYCs, one with AVX512-BF16 and one with AVX2 only, train 4-5x apart: their benchmark files and
    table labels differ; a record from before the tier keeps its old label."""
    from kvshot_lib.evaluation import machine_info, machine_name

    labels = {}
    for tier, flags in {
        "amx": {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"},
        "avx512bf16": {"avx512f", "avx512_bf16"},
        "nobf16": {"avx", "avx2", "fma"},
    }.items():
        monkeypatch.setattr(precision_module, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert precision_module.bf16_tier() == tier
        info = dict(machine_info(), cpu="AMD EPYC", cores=2, gpu=None)
        labels[tier] = machine_name(info)
    assert labels == {t: f"amd-epyc-2cores-{t}" for t in labels}
    old = dict(cpu="AMD EPYC", cores=2, gpu=None)  # a record written before the tier was kept
    assert machine_name(old) == "amd-epyc-2cores"


def test_a_masked_cpu_name_keeps_its_family_and_model():
    """A Zen 4 and a Zen 5 EPYC both read ``AMD EPYC`` behind the hypervisors here; a name with a model number
    is kept as it is."""
    zen = "processor\t: 0\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n"
    names = {precision_module.cpu_name(zen.format(f=f, m=m)) for f, m in ((25, 17), (26, 2))}
    assert names == {"AMD EPYC family 25 model 17", "AMD EPYC family 26 model 2"}
    xeon = "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
    assert precision_module.cpu_name(xeon) == "Intel(R) Xeon(R) Platinum 8488C"
    assert precision_module.cpu_name("", "x86_64") == "x86_64"  # no /proc/cpuinfo
    assert precision_module.cpu_flags_of(zen.format(f=26, m=2)) == {"fpu", "avx2"}


def test_bf16_is_refused_before_any_work(no_bf16_cpu, tiny_llama, tmp_path):
    cfg = TrainConfig(paradigm="hidden", regime="ttt", mixed_precision="bf16", draft_vocab_size=64)
    with pytest.raises(PrecisionError):
        train_drafter(tiny_llama, None, None, cfg, tmp_path / "run", progress=False)  # no store is even read
    assert not (tmp_path / "run").exists()


def _grads(drafter, cfg, batch, precision):
    drafter.zero_grad(set_to_none=True)
    loss, _ = Objective(drafter, cfg, precision)(batch)
    loss.backward()
    return torch.cat([p.grad.flatten().float() for p in drafter.parameters() if p.grad is not None])


@pytest.mark.parametrize("paradigm", PARADIGMS)
def test_one_bf16_step_has_the_float32_gradient(tiny_llama, paradigm):
    """Cosine >= 0.99 between one training step's gradient under bf16 autocast and in float32."""
    g = torch.Generator().manual_seed(0)
    ids, lmask = torch.randint(0, 3000, (40,), generator=g), torch.rand(40, generator=g) < 0.8
    cfg = TrainConfig(paradigm=paradigm, regime="ttt", ttt_steps=3, draft_vocab_size=512)
    dcfg = drafter_config_for(tiny_llama, paradigm, draft_vocab_size=512)
    d = build_drafter(dcfg, tiny_llama, torch.arange(512) * 5, seed=0)
    batch = batch_from_target(tiny_llama, ids, lmask, dcfg)
    fp32, bf16 = _grads(d, cfg, batch, "no"), _grads(d, cfg, batch, "bf16")
    cos = torch.nn.functional.cosine_similarity(fp32, bf16, dim=0)
    assert cos >= 0.99, float(cos)
    assert 0.8 < bf16.norm() / fp32.norm() < 1.25


@pytest.fixture(scope="module")
def peaky():
    """A tiny target with sharp next-token distributions (a random one is nearly uniform: nothing to learn)."""
    t = load_target("tiny-llama", device="cpu", seed=0)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(40.0)
    return t


@pytest.fixture(scope="module")
def stores(peaky, tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("features")
    train = tokenize_sharegpt(tokenizer, "train", 8, 64, seed=0)
    held = tokenize_sharegpt(tokenizer, "eval", 2, 64, seed=0)
    return (
        extract_features(peaky, train, out_dir=root / "t", precision="no"),
        extract_features(peaky, held, out_dir=root / "e", precision="no"),
    )


def test_a_bf16_run_follows_the_float32_loss_curve(amx_cpu, peaky, stores, tmp_path):
    """50 steps of the KV drafter: the bf16 loss curve stays within 3% of float32's, step by step on average
    (5% at any step), and both fall by the same amount."""
    base = dict(
        paradigm="kv",
        regime="ttt",
        ttt_steps=3,
        train_steps=50,
        lr=3e-3,
        warmup_steps=5,
        draft_vocab_size=256,
    )
    base.update(eval_every=0, probe_every=0, save_every=0)
    runs = {
        p: train_drafter(peaky, *stores, TrainConfig(**base, mixed_precision=p), tmp_path / p, progress=False)
        for p in ("no", "bf16")
    }
    fp32, bf16 = (torch.tensor([r["loss"] for r in runs[p].logs["history"]]) for p in ("no", "bf16"))
    rel = (bf16 - fp32).abs() / fp32
    assert float(rel.mean()) < 0.03 and float(rel.max()) < 0.05, rel
    assert float(fp32[-5:].mean()) < 0.8 * float(fp32[:5].mean())  # it learned something
    assert runs["bf16"].drafter.cfg.extra["machine"]["precision"] == "bf16"
    assert runs["no"].drafter.cfg.extra["machine"]["precision"] == "fp32"


def test_bf16_feature_store_round_trips_and_float32_stores_still_load(
    amx_cpu, tiny_llama, tokenizer, tmp_path
):
    split = tokenize_sharegpt(tokenizer, "train", 2, 48, seed=0)
    bf16 = extract_features(tiny_llama, split, out_dir=tmp_path / "bf16", precision="bf16")
    fp32 = extract_features(tiny_llama, split, out_dir=tmp_path / "fp32", dtype="float32", precision="no")
    assert bf16.manifest["dtype"] == "bfloat16" and bf16.manifest["precision"] == "bf16"
    assert fp32.manifest["dtype"] == "float32"
    assert bf16.bytes_per_token == pytest.approx(fp32.bytes_per_token / 2, rel=0.05)  # half the size
    for store in (bf16, fp32):
        again = FeatureStore(store.path)  # reopened from disk
        a, b = again.sequence(1, None), store.sequence(1, None)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    # the bf16 store holds the float32 features to bf16's precision (computed under bf16 autocast)
    a, b = bf16.sequence(0, None), fp32.sequence(0, None)
    for k in ("final_hidden", "keys.1", "values.1"):
        x, y = a[k].float(), b[k].float()
        assert torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0) > 0.99, k
