"""The no-target control (paradigm "none") and the cross-only drafter (paradigm "cross"), on tiny targets.

* The control receives no target information: its training forward and its decode session give the same
  outputs when the target's hidden states and K/V are replaced by noise, while a drafter that reads them
  changes (so the noise really reaches what a drafter could read).
* Both decode exactly as they train (session logits == training unroll, step by step and in a tree).
* Greedy decoding with a trained control reproduces plain greedy decoding token for token, and the control
  does learn (it accepts a real share of drafts), so the equality is not that of a drafter never accepted.
"""

import pytest
import torch

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, speculative_generate
from kvshot_lib.drafters import TargetView, build_drafter, drafter_config_for, load_drafter, save_drafter
from kvshot_lib.training import Objective, TrainConfig, batch_from_target

ATOL = 2e-5


def make(target, paradigm, n_layers=2, kv_mode="concat"):
    cfg = drafter_config_for(target, paradigm, n_layers=n_layers, kv_mode=kv_mode, draft_vocab_size=512)
    d = build_drafter(cfg, target, torch.arange(512) * 3, seed=0)
    with torch.no_grad():  # move off the identity/zero initializations so that every path matters
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 3000, (16,), generator=torch.Generator().manual_seed(1))


def with_target_features(target, ids, layers=(1, 3, 4)):
    """A batch carrying the target's hidden states and K/V of ``layers`` (as a hybrid drafter would read)."""
    cfg = drafter_config_for(target, "hybrid", hidden_layers=layers, kv_layers=layers, draft_vocab_size=512)
    return batch_from_target(target, ids, torch.ones(len(ids), dtype=torch.bool), cfg)


def noised(batch):
    g = torch.Generator().manual_seed(5)
    out = batch.to("cpu")
    for name in ("hidden", "keys", "values"):
        x = getattr(out, name)
        setattr(out, name, torch.randn(x.shape, generator=g) * 3)
    return out


@torch.no_grad()
def view(target, ids, noise: bool = False):
    """The engine's view before drafting after ``ids`` (optionally with every cached K/V and hidden state noised)."""
    P = len(ids) - 1
    out = target.model(input_ids=ids[None, :P], use_cache=True, output_hidden_states=True)
    cache, hidden = out.past_key_values, {i: out.hidden_states[i + 1][:, :P] for i in range(8)}
    if noise:
        g = torch.Generator().manual_seed(9)
        for layer in cache.layers:
            layer.keys = torch.randn(layer.keys.shape, generator=g)
            layer.values = torch.randn(layer.values.shape, generator=g)
        hidden = {i: torch.randn(h.shape, generator=g) for i, h in hidden.items()}
    return TargetView(cache=cache, hidden=hidden)


def test_control_config_reads_no_target_layer(tiny_llama):
    cfg = drafter_config_for(tiny_llama, "none", draft_vocab_size=512)
    assert cfg.hidden_layers == () and cfg.kv_layers == ()
    assert not cfg.uses_hidden and not cfg.uses_target_kv and cfg.own_context
    d = build_drafter(cfg, tiny_llama, torch.arange(512), seed=0)
    assert d.hidden_layers == () and d.new_session().hidden_layers == ()
    names = [n for n, _ in d.named_parameters()]
    assert not any(n.startswith("fc") or "inject" in n or "cross" in n for n in names), names


def test_control_training_forward_ignores_target_features(tiny_llama, ids):
    batch = with_target_features(tiny_llama, ids)
    control, hybrid = make(tiny_llama, "none"), make(tiny_llama, "hybrid")
    with torch.no_grad():
        a, b = control(batch, 4), control(noised(batch), 4)
        for x, y in zip(a.outs, b.outs):
            assert torch.equal(x, y)
        h1, h2 = hybrid(batch, 4), hybrid(noised(batch), 4)  # the noise does reach a drafter that reads it
        assert (h1.outs[0] - h2.outs[0]).abs().max() > 1e-2


def test_control_decode_session_ignores_target_features(tiny_llama, ids):
    control, kv = make(tiny_llama, "none"), make(tiny_llama, "kv")
    for d, reads in ((control, False), (kv, True)):
        outs = []
        for noise in (False, True):
            s = d.new_session()
            root = s.start_cycle(ids[None, :9], view(tiny_llama, ids[:9], noise))
            tree = s.expand(torch.tensor([11, 22, 33]), torch.tensor([-1, -1, 0]))
            outs.append(torch.cat([root[None], tree]))
        same = torch.equal(outs[0], outs[1])
        assert same != reads, f"{d.paradigm}: decode output {'changed' if not same else 'did not change'}"


@pytest.mark.parametrize("paradigm,mode", [("none", "concat"), ("cross", "linear_rope"), ("cross", "concat")])
def test_session_matches_training_unroll(tiny_target, ids, paradigm, mode):
    d = make(tiny_target, paradigm, kv_mode=mode)
    K, T = 4, len(ids)
    with torch.no_grad():
        un = d(batch_from_target(tiny_target, ids, torch.ones(T, dtype=torch.bool), d.cfg), K)
        train_logits = [d.logits(h)[0] for h in un.outs]  # each [N, V_draft]
    for i in (0, 3, 9):
        s = d.new_session()
        got = [s.start_cycle(ids[None, : i + 2], view(tiny_target, ids[: i + 2]))]
        for k in range(1, K):
            got.append(s.expand(ids[i + 1 + k : i + 2 + k], torch.tensor([k - 2]))[0])
        s.end_cycle()
        for k in range(K):
            torch.testing.assert_close(got[k], train_logits[k][i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("paradigm", ["none", "cross"])
def test_cycles_ingest_only_new_positions(tiny_llama, ids, paradigm):
    """A second cycle over a longer context equals a fresh session started there (positions ingested once)."""
    d = make(tiny_llama, paradigm)
    s = d.new_session()
    s.start_cycle(ids[None, :6], view(tiny_llama, ids[:6]))
    s.expand(torch.tensor([5, 6]), torch.tensor([-1, 0]))
    s.end_cycle()
    v = view(tiny_llama, ids[:11])
    v.hidden = {i: h[:, 5:] for i, h in v.hidden.items()}  # only the positions committed since
    again = s.start_cycle(ids[None, :11], v)
    fresh = d.new_session().start_cycle(ids[None, :11], view(tiny_llama, ids[:11]))
    torch.testing.assert_close(again, fresh, atol=ATOL, rtol=0)


def test_control_checkpoint_round_trip(tiny_llama, tmp_path):
    d = make(tiny_llama, "none")
    save_drafter(d, tmp_path / "ctl")
    back = load_drafter(tmp_path / "ctl", tiny_llama)
    assert back.cfg.paradigm == "none"
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_trained_control_decodes_exactly_like_plain_greedy(llama):
    """Greedy decoding with a control trained on the target's own continuations equals plain greedy decoding."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 3000, (n,), generator=g).tolist() for n in (7, 12, 20)]
    plain = DecodeConfig(mode="ar", max_new_tokens=24, stop_token_ids=())
    reference = [autoregressive_generate(llama, p, plain).token_ids for p in prompts]
    d2t = torch.unique(torch.tensor(sum(reference, [])))
    cfg = drafter_config_for(llama, "none", draft_vocab_size=len(d2t))
    drafter = build_drafter(cfg, llama, d2t, seed=0)
    batches = []
    for p, r in zip(prompts, reference):
        mask = torch.zeros(len(p) + len(r), dtype=torch.bool)
        mask[len(p) - 1 :] = True
        batches.append(batch_from_target(llama, torch.tensor(p + r), mask, cfg).to(llama.model.device))
    objective = Objective(drafter, TrainConfig(paradigm="none", regime="ttt", ttt_steps=3))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(150):
        loss, _ = objective(batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    for mode, kw in (
        ("chain", dict(chain_depth=4)),
        ("tree", dict(tree_depth=4, tree_top_k=3, tree_budget=10)),
    ):
        accepted = drafted = 0
        for p, ref in zip(prompts, reference):
            out = speculative_generate(
                llama, drafter, p, DecodeConfig(mode=mode, max_new_tokens=24, stop_token_ids=(), **kw)
            )
            assert out.token_ids == ref, f"{mode}: the control's output differs from plain greedy decoding"
            accepted += sum(out.step_accepts)
            drafted += sum(out.step_attempts)
        assert accepted / drafted > 0.2, f"{mode}: the trained control accepted only {accepted / drafted:.2f}"
