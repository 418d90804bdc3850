"""The block drafter (DFlash-style parallel drafting, ``drafters/block.py``) on tiny models, CPU.

* its K outputs read no target position after the block's root (bitwise), in training and decoding alike;
* a decoding session computes what the training forward computes at the same anchor;
* one drafter forward drafts the whole block (counted), and greedy decoding with it equals plain decoding,
  chain and tree, on the engine tests' prompts;
* it learns from the target's context: on a copy task that only the context can solve, a trained block
  drafter is nearly always right and the same drafter trained with the context zeroed is at chance;
* the training loop, its gradient probes and checkpoints handle it like the other drafters.
"""

import pytest
import torch
from conftest import random_prompts
from test_decoding_sampling import (
    N_TOKENS,
    PROMPT,
    SAMPLED,
    SHAPES,
    TOP_K,
    assert_follows,
    exact_joint,
    runs_for_power,
    sample_outcomes,
    small,  # noqa: F401 (the fixture)
)

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, speculative_generate
from kvshot_lib.drafters import (
    DrafterConfigError,
    DrafterTargetMismatch,
    Segment,
    TargetView,
    build_drafter,
    drafter_config_for,
    load_drafter,
    save_drafter,
    segmented_attention,
)
from kvshot_lib.training import (
    Objective,
    TrainConfig,
    TrainConfigError,
    batch_from_target,
    collate,
    kv_ablation_table,
    sample_anchors,
    step_mask,
    target_sequence,
    train_drafter,
)

CONTEXTS = ("kv", "hidden", "both")


def block_drafter(
    target, context, K=4, n_layers=2, kv_mode="linear_rope", vocab=None, target_kv="real", layers=None
):
    d2t = torch.arange(512) * 5 if vocab is None else vocab
    cfg = drafter_config_for(
        target,
        "block",
        n_layers=n_layers,
        kv_mode=kv_mode,
        draft_vocab_size=len(d2t),
        context=context,
        block_size=K,
        regime="parallel",
        target_kv=target_kv,
        hidden_layers=layers,
        kv_layers=layers,
    )
    return build_drafter(cfg, target, d2t, seed=0)


def perturbed(d):
    """The drafter with every parameter moved off its initialization, so that every path matters."""
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return d.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 3000, (18,), generator=torch.Generator().manual_seed(4))


def test_block_segment_equals_dense_attention_with_a_block_mask():
    g = torch.Generator().manual_seed(0)
    B, kvh, gq, M, L, D, S = 2, 3, 2, 4, 5, 8, 7
    q = torch.randn(B, kvh * gq, M * L, D, generator=g)
    ctx_k, ctx_v = torch.randn(B, kvh, S, D, generator=g), torch.randn(B, kvh, S, D, generator=g)
    k, v = torch.randn(B, kvh, M * L, D, generator=g), torch.randn(B, kvh, M * L, D, generator=g)
    visible = torch.rand(B, 1, 1, M * L, S, generator=g) < 0.6
    visible[..., 0] = True
    got = segmented_attention(q, [Segment(ctx_k, ctx_v, "dense", visible), Segment(k, v, "block", size=L)])
    blocks = torch.arange(M * L) // L
    mask = torch.cat(
        [visible.expand(B, 1, 1, M * L, S)[:, 0, 0], (blocks[:, None] == blocks[None]).expand(B, -1, -1)], -1
    )
    keys, values = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)  # [B, kvH, S + n, D]
    scores = (q.view(B, kvh, gq, M * L, D) @ keys[:, :, None].transpose(-1, -2)) * D**-0.5
    want = torch.softmax(scores.masked_fill(~mask[:, None, None], float("-inf")), -1) @ values[:, :, None]
    torch.testing.assert_close(got, want.reshape(B, kvh * gq, M * L, D), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kv_mode", ["concat", "linear_rope"])
def test_outputs_never_read_a_target_position_after_the_root(tiny_llama, ids, context, kv_mode):
    """Branch i's block (root x_{i+1}) reads target positions 0..i only: noise in the target's K, V and hidden
    states at every later position leaves its K outputs bitwise unchanged, and changes later branches'."""
    d = perturbed(block_drafter(tiny_llama, context, kv_mode=kv_mode))
    T = len(ids)
    batch = batch_from_target(tiny_llama, ids, torch.ones(T, dtype=torch.bool), d.cfg)
    with torch.no_grad():
        before = torch.stack(d(batch, 4).outs)  # [K, 1, N, H]
        for i in (0, 5, 11):
            noisy = collate([target_sequence(tiny_llama, ids, torch.ones(T, dtype=torch.bool), d.cfg)], d.cfg)
            for name in ("keys", "values", "hidden"):
                x = getattr(noisy, name)
                if x is not None:
                    x[:, i + 1 :] += 3.0 * torch.randn_like(x[:, i + 1 :])
            after = torch.stack(d(noisy, 4).outs)
            assert torch.equal(after[:, :, : i + 1], before[:, :, : i + 1]), (
                f"branch <= {i} read a later position"
            )
            assert not torch.allclose(
                after[:, :, i + 1 :], before[:, :, i + 1 :]
            )  # later branches do read it


@pytest.mark.parametrize("context", CONTEXTS)
def test_session_matches_the_training_forward(tiny_target, ids, context):
    """On both target families: a decoding session's K rows equal the training forward's at the same anchor;
    depths past the block are declined (all -inf)."""
    d = perturbed(block_drafter(tiny_target, context, kv_mode="linear"))
    T, K = len(ids), 4
    with torch.no_grad():
        un = d(batch_from_target(tiny_target, ids, torch.ones(T, dtype=torch.bool), d.cfg), 7)
        out = tiny_target.model(input_ids=ids[None], use_cache=True, output_hidden_states=True)
    assert len(un.outs) == K  # a block drafter drafts K steps, however many are asked
    s = d.new_session()  # one session over a growing context, as in decoding
    for i in range(T - 1):
        P = i + 1
        cache = tiny_target.model(input_ids=ids[None, :P], use_cache=True).past_key_values
        given = {
            j: out.hidden_states[j + 1][:, i:P] for j in range(8)
        }  # the positions new since the last cycle
        rows = [s.start_cycle(ids[None, : P + 1], TargetView(cache, given))]
        rows += list(
            s.expand(torch.zeros(K, dtype=torch.long), torch.arange(-1, K - 1))
        )  # a chain of K nodes
        s.end_cycle()
        for k in range(K):
            torch.testing.assert_close(rows[k], d.logits(un.outs[k][0, i]), atol=2e-5, rtol=1e-5)
        assert torch.isinf(rows[K]).all() and (rows[K] < 0).all()


def train_on_reference(target, prompts, reference, context, steps=150, K=4, layers=None):
    """A block drafter trained (parallel regime) on the target's greedy continuations, so that it is partly right."""
    d2t = torch.unique(torch.cat([torch.tensor(r) for r in reference]))
    d = block_drafter(target, context, K=K, n_layers=1, vocab=d2t, layers=layers)
    batches = []
    for p, r in zip(prompts, reference):
        ids = torch.tensor(p + r)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p) - 1 :] = True
        batches.append(batch_from_target(target, ids, mask, d.cfg))
    objective = Objective(d, TrainConfig(paradigm="block", regime="parallel", context=context, ttt_steps=K))
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    for step in range(steps):
        loss, _ = objective(batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(24, seed=321)


@pytest.fixture(scope="module")
def reference(llama, prompts):
    cfg = DecodeConfig(mode="ar", max_new_tokens=12, stop_token_ids=())
    return [autoregressive_generate(llama, p, cfg).token_ids for p in prompts]


@pytest.fixture(scope="module", params=["kv", "hidden"])
def trained(request, llama, prompts, reference):
    steps = {"kv": 150, "hidden": 300}[request.param]  # the hidden-state context is learnt more slowly here
    return train_on_reference(llama, prompts, reference, request.param, steps=steps)


class Counting:
    """Wraps a drafter: counts the forwards of its first layer and the cycles its sessions start."""

    def __init__(self, drafter):
        self.d, self.name, self.forwards, self.cycles = drafter, drafter.name, 0, 0
        self.hook = drafter.layers[0].register_forward_hook(
            lambda *_: setattr(self, "forwards", self.forwards + 1)
        )

    def new_session(self):
        session = self.d.new_session()
        start = session.start_cycle

        def counted(*args):
            self.cycles += 1
            return start(*args)

        session.start_cycle = counted
        return session


@pytest.mark.parametrize(
    "mode,kw",
    [
        ("chain", dict(chain_depth=4)),
        ("chain", dict(chain_depth=6)),
        ("tree", dict(tree_depth=4, tree_top_k=3, tree_budget=10)),
    ],
)
def test_greedy_equals_plain_decoding_with_one_forward_per_cycle(
    llama, prompts, reference, trained, mode, kw
):
    drafter = Counting(trained)
    cfg = DecodeConfig(mode=mode, max_new_tokens=12, stop_token_ids=(), **kw)
    accepted = attempted = 0
    try:
        for prompt, ref in zip(prompts, reference):
            out = speculative_generate(llama, drafter, prompt, cfg)
            assert out.token_ids == ref, (
                f"{trained.cfg.context} {mode} {kw}: differs from plain greedy decoding"
            )
            accepted, attempted = accepted + sum(out.step_accepts), attempted + sum(out.step_attempts)
            if mode == "chain":  # a whole block per cycle (K = 4, fewer only where max_new_tokens caps it)
                assert max(out.drafted_per_cycle) == 4 and all(n <= 4 for n in out.drafted_per_cycle)
    finally:
        drafter.hook.remove()
    assert (
        drafter.forwards == drafter.cycles > len(prompts)
    )  # one drafter forward per cycle, whatever the depth
    # partly right (a random drafter accepts < 0.02), so acceptances and rejections both occur
    assert accepted / attempted > 0.1, f"the block drafter accepted only {accepted / attempted:.3f}"


@pytest.fixture(scope="module")
def small_block(small):  # noqa: F811
    """A block drafter (K = 4, target-KV context) trained on 16 continuations of the sampling tests' prompt
    that the small 32-token target sampled (temperature 1, top-k 2), so that it is partly right there."""
    cfgs = [DecodeConfig(mode="ar", seed=i, **SAMPLED) for i in range(16)]
    reference = [autoregressive_generate(small, PROMPT, cfg).token_ids for cfg in cfgs]
    return train_on_reference(small, [PROMPT] * 16, reference, "kv", steps=150, layers=(0, 1))


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_output_follows_the_target_distribution(small, small_block, mode):  # noqa: F811
    """Temperature 1, top-k 2: the first five tokens decoded with the block drafter (rejection rule in the chain,
    sample-and-match in the tree) follow the target's exact joint distribution. On the small 32-token target of
    ``test_decoding_sampling``, whose outcomes are close to even, and with the smallest number of runs that
    gives the chi-square test power 0.8 against a 5% distortion; drafts are verified down to the depth named
    (3 in the chain, 2 in the tree), and both accepted and rejected."""
    joint = exact_joint(small, PROMPT, N_TOKENS, 1.0, TOP_K)
    n_runs = runs_for_power(joint, 0.8)
    # a tree of 6 nodes, 2 per parent, fills its budget at depth 2 (2 + 4 nodes); a chain goes 3 deep
    depth = 3 if mode == "chain" else 2
    cfg = {**SAMPLED, **SHAPES, "mode": mode, "chain_depth": depth, "tree_depth": depth}
    counts, accepted, drafted, by_step = sample_outcomes(small, small_block, [cfg], n_runs, joint)
    assert_follows(counts, joint, n_runs)
    assert 0.1 < accepted / drafted < 0.9, (
        f"the test needs accepted and rejected drafts: {accepted}/{drafted}"
    )
    assert by_step[depth - 1] >= 10, f"the test needs drafts verified at depth {depth}: {by_step}"


COPY_ALPHABET = torch.arange(16) * 37 + 200  # 16 target token ids
PERIOD, COPY_LEN = 5, 32


def copy_batch(target, cfg, n, seed):
    """Sequences that repeat a random 5-token pattern, so that x_{i+2..} is a copy of the context (only the
    context can tell it: the root alone leaves 15 choices). The labels are the true next tokens: the
    "target's" distribution at position t is made peaked on x_{t+1}."""
    g = torch.Generator().manual_seed(seed)
    seqs = [COPY_ALPHABET[torch.randperm(16, generator=g)[:PERIOD]].repeat(7)[:COPY_LEN] for _ in range(n)]
    batch = collate(
        [target_sequence(target, s, torch.ones(COPY_LEN, dtype=torch.bool), cfg) for s in seqs], cfg
    )
    emb = target.model.model.embed_tokens.weight.detach()  # tied with the LM head in the tiny targets
    nxt = emb[torch.cat([batch.ids[:, 1:], batch.ids[:, -1:]], 1)]  # [B, T, H]
    batch.final_hidden = 8.0 * nxt * emb.shape[1] ** 0.5 / nxt.norm(dim=-1, keepdim=True) ** 2
    return batch


def copy_accuracy(d, batch, K):
    with torch.no_grad():
        un = d(batch, K)
    want = [
        batch.ids[:, PERIOD + 2 + k :] for k in range(K)
    ]  # branches i >= PERIOD: a full period in context
    return [
        float((d.d2t[d.logits(un.outs[k][:, PERIOD : PERIOD + w.shape[1]]).argmax(-1)] == w).float().mean())
        for k, w in enumerate(want)
    ]


@pytest.mark.slow  # ~5 s each: make test-slow, which CI runs
@pytest.mark.parametrize("context", CONTEXTS)
def test_learns_what_only_the_context_tells(tiny_llama, context):
    K, accuracy = 3, {}
    for target_kv in ("real", "zeroed"):
        d = block_drafter(tiny_llama, context, K=K, n_layers=1, vocab=COPY_ALPHABET, target_kv=target_kv)
        batches = [copy_batch(tiny_llama, d.cfg, 4, seed) for seed in range(20)]
        label = torch.softmax(batches[0].final_hidden @ d.head.T, -1)  # [B, T, 16]
        assert (d.d2t[label.argmax(-1)][:, :-1] == batches[0].ids[:, 1:]).all() and label.max(
            -1
        ).values.min() > 0.9
        cfg = TrainConfig(
            paradigm="block", regime="parallel", context=context, ttt_steps=K, target_kv=target_kv
        )
        objective, opt = Objective(d, cfg), torch.optim.Adam(d.parameters(), lr=3e-3)
        for step in range(120):
            loss, _ = objective(batches[step % len(batches)])
            opt.zero_grad()
            loss.backward()
            opt.step()
        accuracy[target_kv] = copy_accuracy(d.eval(), copy_batch(tiny_llama, d.cfg, 16, 999), K)
    assert min(accuracy["real"]) > 0.8, accuracy
    assert max(accuracy["zeroed"]) < 0.3, accuracy  # chance is about 1/15


def test_anchors_are_random_per_sequence_and_valid_first():
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[0, 5:30], valid[1, :], valid[2, 30:35] = True, True, True
    a = sample_anchors(valid, 0.25, seed=1)  # [3, 10]
    assert a.shape == (3, 10) and (a.diff(dim=1) > 0).all()
    assert valid.gather(1, a)[:2].all() and valid.gather(1, a)[2].sum() == 5  # only 5 valid in row 2
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, sample_anchors(valid, 0.25, seed=2))
    assert sample_anchors(valid, 0.25, seed=1, rows_per_anchor=4).shape[1] == 9  # 10 * 4 = 40 = N: one fewer


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(paradigm="block", regime="ttt", context="kv"), "trains under regime 'parallel' only"),
        (dict(paradigm="kv", regime="parallel"), "trains under regime 'parallel' only"),
        (dict(paradigm="block", regime="parallel"), "needs context in"),
        (dict(paradigm="block", regime="parallel", context="kv", n_layers=6), "n_layers must be in 1..5"),
        (dict(paradigm="kv", regime="ttt", context="kv"), "context is a block-drafter parameter"),
        (dict(paradigm="block", regime="parallel", context="kv", kv_align_weight=1.0), "unrolled regimes"),
    ],
)
def test_bad_block_parameters_are_refused(params, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig.from_params(params)


def test_bad_block_config_is_refused(tiny_llama):
    with pytest.raises(DrafterConfigError, match="needs context in"):
        drafter_config_for(tiny_llama, "block", context="all", block_size=4)
    with pytest.raises(DrafterConfigError, match="belong to the block drafter"):
        drafter_config_for(tiny_llama, "kv", context="kv")


def test_checkpoint_roundtrip_and_target_binding(tiny_llama, tiny_qwen3, ids, tmp_path):
    d = perturbed(block_drafter(tiny_llama, "both"))
    save_drafter(d, tmp_path / "b")
    back = load_drafter(tmp_path / "b", tiny_llama)
    assert (
        back.cfg.context == "both"
        and back.cfg.block_size == 4
        and back.cfg.hidden_layers
        and back.cfg.kv_layers
    )
    a, b = d.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "mask_embedding" in a and "fc.weight" in a and "layers.0.inject.k_map.weight" in a
    with pytest.raises(DrafterTargetMismatch):
        load_drafter(tmp_path / "b", tiny_qwen3)


def test_training_loop_probes_and_ablation(tiny_llama, stores_small, tmp_path):
    """``train_drafter`` trains a block drafter like the others: gradient probes see its own K/V (the hidden
    context's at own_step 0, the block's at 1), held-out accuracy stops at its block, the KV ablation reads it."""
    train, held = stores_small
    params = dict(
        paradigm="block",
        regime="parallel",
        context="both",
        n_layers=2,
        ttt_steps=3,
        train_steps=4,
        batch_size=2,
        draft_vocab_size=512,
        eval_every=2,
        eval_sequences=2,
        eval_steps=5,
        probe_every=1,
        branch_fraction=0.25,
    )
    result = train_drafter(tiny_llama, train, held, params, tmp_path / "block", progress=False)
    probes = result.table("grad_probes")
    kv = probes[probes["group"] == "kv_proj"]
    assert len(kv) == 4 and (kv["l2"] > 0).all() and (kv["n_positions"] > 0).all()
    assert (kv["n_positions"] <= kv["n_positions_total"]).all()
    positions = result.table("kv_positions")
    assert set(positions["own_step"]) == {0, 1} and (positions["grad_k_mean"] > 0).all()
    assert set(result.table("attention_mass")["segment"]) == {"target", "own_context", "own_branch"}
    final = result.final_eval()
    assert final["n_2"] > 0 and final["acc_3"] != final["acc_3"] and final["n_3"] == 0  # NaN past the block
    loaded = load_drafter(tmp_path / "block", tiny_llama)
    assert loaded.regime == "parallel" and loaded.cfg.block_size == 3
    table = kv_ablation_table([result], held, tiny_llama, 3, 2, 2)
    assert set(table["condition"]) == {"real", "zeroed", "shuffled"} and (table["n"] > 0).all()


@pytest.fixture(scope="module")
def stores_small(tiny_llama, tmp_path_factory, tokenizer):
    from kvshot_lib.corpus import extract_features, tokenize_sharegpt

    root = tmp_path_factory.mktemp("block_features")
    train = tokenize_sharegpt(tokenizer, "train", 4, 64, seed=0)
    held = tokenize_sharegpt(tokenizer, "eval", 2, 64, seed=0)
    return extract_features(tiny_llama, train, out_dir=root / "train"), extract_features(
        tiny_llama, held, out_dir=root / "eval"
    )


def test_per_sequence_anchors_run_the_same_blocks(tiny_llama, ids):
    """Per-sequence anchors ([B, M]) give the same loss as running every branch and keeping those rows."""
    d = perturbed(block_drafter(tiny_llama, "kv"))
    T = len(ids)
    seq = target_sequence(
        tiny_llama, ids, torch.rand(T, generator=torch.Generator().manual_seed(2)) < 0.7, d.cfg
    )
    batch = collate([seq, {k: v.clone() for k, v in seq.items()}], d.cfg)
    anchors = sample_anchors(step_mask(batch, 0), 0.5, seed=3)  # [2, M], different per sequence
    assert not torch.equal(anchors[0], anchors[1])
    with torch.no_grad():
        full = d(batch, 4)
        part = d(batch, 4, branches=anchors)
    for k in range(4):
        for b in range(2):
            torch.testing.assert_close(part.outs[k][b], full.outs[k][b, anchors[b]], atol=1e-5, rtol=1e-5)
