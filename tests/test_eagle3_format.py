"""The shared EAGLE-3 layout, out and in: the round trip gives the same drafts, the conventions are converted as the
engines read them, the drafters without such a layout are refused, and speculators' own EAGLE-3 model computes the
suite's draft logits (where ``make interop-env`` has built ``.venv-serve``)."""

import json
import subprocess

import pytest
import torch
from conftest import trained_like
from safetensors.torch import load_file, save_file

from kvshot_lib.drafters import (
    DrafterConfigError,
    DrafterTargetMismatch,
    build_drafter,
    drafter_config_for,
    drafters_for_run,
    export_eagle3,
    is_eagle3_folder,
    load_drafter,
)
from kvshot_lib.target import REPO_ROOT, assets, load_target
from kvshot_lib.training import batch_from_target

SERVE_PYTHON = REPO_ROOT / ".venv-serve" / "bin" / "python"


def eagle31_like(target, seed=0):
    cfg = drafter_config_for(
        target, "hidden", draft_vocab_size=512, fc_norm=True, norm_output=True, name="h31"
    )
    d = build_drafter(cfg, target, torch.arange(512) * 7, seed=seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


def unrolled_logits(d, target, ids, steps=3):
    b = batch_from_target(target, ids, torch.ones(len(ids), dtype=torch.bool), d.cfg)
    with torch.no_grad():
        return [d.logits(h) for h in d(b, steps).outs], b


@pytest.mark.parametrize(
    "make", [lambda t: trained_like(t, "hidden").eval(), eagle31_like], ids=["eagle3", "eagle31"]
)
def test_export_then_import_gives_the_same_drafts(tiny_llama, tmp_path, make):
    torch.manual_seed(0)
    d = make(tiny_llama)
    out = export_eagle3(d, tiny_llama, tmp_path / "e3")
    assert is_eagle3_folder(out)
    back = load_drafter(out, tiny_llama)
    ids = torch.randint(0, 3000, (20,), generator=torch.Generator().manual_seed(2))
    for a, b in zip(unrolled_logits(d, tiny_llama, ids)[0], unrolled_logits(back, tiny_llama, ids)[0]):
        assert torch.equal(a, b)
    assert back.cfg.fc_norm == d.cfg.fc_norm and back.cfg.norm_output == d.cfg.norm_output


def test_the_layout_follows_the_engines_conventions(tiny_llama, tmp_path):
    d = trained_like(tiny_llama, "hidden")  # d2t = 0, 7, 14, ...: target id = 7 x draft id
    out = export_eagle3(d, tiny_llama, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    # the embedding counts as layer 0 in the engines: the suite's layer l is their l + 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [x + 1 for x in d.cfg.hidden_layers]
    assert torch.equal(w["d2t"], torch.arange(512) * 6)  # offsets: 7j - j
    assert w["t2d"].dtype == torch.bool and w["t2d"].sum() == 512 and w["t2d"][7 * 511] and not w["t2d"][1]
    assert torch.equal(w["lm_head.weight"], tiny_llama.model.lm_head.weight[torch.arange(512) * 7])
    assert w["fc.weight"].shape == (d.cfg.hidden_size, 3 * d.cfg.hidden_size)
    assert "embed_tokens.weight" not in w and not any(k.startswith("layers.") for k in w)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * d.cfg.hidden_size


def test_drafters_without_an_eagle3_layout_are_refused(tiny_llama, tmp_path):
    for paradigm in ("kv", "hybrid", "none"):
        with pytest.raises(DrafterConfigError, match="no EAGLE-3 layout"):
            export_eagle3(trained_like(tiny_llama, paradigm), tiny_llama, tmp_path / paradigm)
    two = build_drafter(drafter_config_for(tiny_llama, "hidden", n_layers=2, draft_vocab_size=64), tiny_llama,
                        torch.arange(64))  # fmt: skip
    with pytest.raises(DrafterConfigError, match="2 layers"):
        export_eagle3(two, tiny_llama, tmp_path / "two")


def test_import_refuses_another_target_and_other_arithmetic(tiny_llama, tmp_path):
    out = export_eagle3(trained_like(tiny_llama, "hidden"), tiny_llama, tmp_path / "e3")
    with pytest.raises(DrafterTargetMismatch, match="exported for target"):
        load_drafter(out, load_target("tiny-qwen3", device="cpu"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("kvshot")  # a public checkpoint: only its widths say which target it is for
    (out / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 1)))
    with pytest.raises(DrafterTargetMismatch, match="vocab_size"):
        load_drafter(out, tiny_llama)
    (out / "config.json").write_text(json.dumps(dict(cfg, norm_before_residual=True)))
    with pytest.raises(DrafterConfigError, match="norm_before_residual"):
        load_drafter(out, tiny_llama)


def test_a_public_drafters_own_head_and_embedding_are_used(tiny_llama, tmp_path):
    d = trained_like(tiny_llama, "hidden").eval()
    out = export_eagle3(d, tiny_llama, tmp_path / "e3")
    w = load_file(str(out / "model.safetensors"))
    w["lm_head.weight"] = 2 * w["lm_head.weight"]  # a head trained away from the target's rows
    w["embed_tokens.weight"] = tiny_llama.model.model.embed_tokens.weight.detach().flip(0).contiguous()
    save_file(w, str(out / "model.safetensors"))
    back = load_drafter(out, tiny_llama)
    assert torch.equal(back.head, w["lm_head.weight"])
    ids = torch.tensor([3, 5, 7])
    assert torch.equal(back.embed(ids), w["embed_tokens.weight"][ids])


@pytest.mark.skipif(
    not SERVE_PYTHON.is_file(), reason="needs .venv-serve (make interop-env) with speculators"
)
@pytest.mark.parametrize("which", ["reference-hidden-ttt", "eagle31"])
def test_speculators_computes_the_suites_draft_logits(tmp_path, which):
    """speculators converts the export, loads it as its own EAGLE-3 model and gives the same first-step logits."""
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    if which == "eagle31":
        d = eagle31_like(target)
    else:
        d = load_drafter(REPO_ROOT / "checkpoints" / "reference" / "hidden-ttt", target)
    out = export_eagle3(d, target, tmp_path / "e3")
    ids = torch.tensor(
        target.tokenizer("Speculative decoding drafts tokens that the target verifies.")["input_ids"]
    )
    (ours, *_), b = unrolled_logits(d, target, ids, steps=1)
    T = len(ids)
    save_file({"hidden": b.hidden[:, : T - 1].float().contiguous(), "input_ids": ids[None, 1:].contiguous()},
              str(tmp_path / "in.safetensors"))  # fmt: skip
    script = REPO_ROOT / "scripts" / "interop" / "speculators_forward.py"
    args = [
        str(SERVE_PYTHON),
        str(script),
        str(out),
        str(assets.smollm2_model_dir()),
        str(tmp_path / "in.safetensors"),
    ]
    subprocess.run([*args, str(tmp_path / "out.safetensors")], check=True, capture_output=True, timeout=300)
    theirs = load_file(str(tmp_path / "out.safetensors"))["logits"]
    torch.testing.assert_close(theirs, ours[0], atol=1e-4, rtol=1e-4)


def test_the_notebooks_measure_an_eagle3_folder_beside_the_runs_drafters(tiny_llama, tmp_path):
    """drafters_for_run(extra=[folder]): what notebook 03's extra_drafters hands to the acceptance measurement."""
    d = trained_like(tiny_llama, "hidden").eval()
    out = export_eagle3(d, tiny_llama, tmp_path / "public-eagle3")
    drafters, note = drafters_for_run(None, tiny_llama, ("ngram",), extra=[out])
    assert set(drafters) == {"ngram", "public-eagle3"} and "from folders: 1" in note
    ids = torch.randint(0, 3000, (12,), generator=torch.Generator().manual_seed(5))
    for a, b in zip(
        unrolled_logits(d, tiny_llama, ids)[0], unrolled_logits(drafters["public-eagle3"], tiny_llama, ids)[0]
    ):
        assert torch.equal(a, b)


def test_a_committed_checkpoint_beside_a_trained_drafter_of_its_name_keeps_both(tiny_llama, tmp_path):
    """extra=[checkpoints/reference/<row>] beside runs/<run>/drafters/<row>: both measured, told apart."""
    from kvshot_lib.drafters import save_drafter

    fresh, committed = trained_like(tiny_llama, "hidden"), trained_like(tiny_llama, "hidden")
    save_drafter(fresh, tmp_path / "run" / "drafters" / "hidden-ttt")
    save_drafter(committed, tmp_path / "checkpoints" / "reference" / "hidden-ttt")
    extra = [tmp_path / "checkpoints" / "reference" / "hidden-ttt"]
    drafters, _ = drafters_for_run(tmp_path / "run", tiny_llama, ("ngram",), extra=extra)
    assert set(drafters) == {"ngram", "hidden-ttt", "hidden-ttt@reference"}
    ids = torch.randint(0, 3000, (12,), generator=torch.Generator().manual_seed(5))
    first = {
        label: unrolled_logits(d, tiny_llama, ids)[0][0] for label, d in drafters.items() if label != "ngram"
    }
    assert not torch.equal(first["hidden-ttt"], first["hidden-ttt@reference"])
    assert torch.equal(first["hidden-ttt"], unrolled_logits(fresh, tiny_llama, ids)[0][0])
    assert torch.equal(first["hidden-ttt@reference"], unrolled_logits(committed, tiny_llama, ids)[0][0])
    # a committed checkpoint of a row this run did not train still says which run it comes from
    save_drafter(committed, tmp_path / "checkpoints" / "onpolicy" / "hidden31-ttt")
    extra.append(tmp_path / "checkpoints" / "onpolicy" / "hidden31-ttt")
    drafters, _ = drafters_for_run(tmp_path / "run", tiny_llama, ("ngram",), extra=extra)
    assert set(drafters) == {"ngram", "hidden-ttt", "hidden-ttt@reference", "hidden31-ttt@onpolicy"}
    # kvshot bench labels its rows the same way
    from kvshot_lib.evaluation import cli as bench_cli

    assert (
        bench_cli._label(str(extra[-1])) == "hidden31-ttt@onpolicy" and bench_cli._label("ngram") == "ngram"
    )
    assert bench_cli._label(str(tmp_path / "run" / "drafters" / "hidden-ttt")) == "hidden-ttt"
