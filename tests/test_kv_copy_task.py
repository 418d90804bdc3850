"""A task only the target's KV can solve: the KV-only drafter learns it, its zeroed-KV control cannot.

The target (``secret_task.py``, built by hand) continues every prompt with ``0, s, 0, s, ...``, where the
secret ``s`` (one of 8) sits early in the prompt: the secret after filler 0 is in the target's K/V and in
nothing else the KV-only drafter sees (its root is 0, its own keys hold only the root and its drafts).

Both drafters are trained through the real objective (``Objective`` -> the unroll and ``regime_loss``,
``build_optimizer``, clipping as in the training loop) for 80 steps on 48 prompts, one KV-only drafter with
the target's K/V and one with them zeroed (``target_kv="zeroed"``, the no-target control). On 16 held-out
prompts (each secret twice), at draft step 0 on the positions where the target says the secret:

* the KV-only drafter's accuracy is >= 0.9 (chance: 1/8);
* the same drafter with the target's K/V zeroed at evaluation falls to chance, and given another prompt's
  K/V it names that prompt's secret;
* the control stays at chance: it cannot tell the secrets apart, and each secret is as frequent.

``tests/test_decoding.py`` measures the same through the decoding engine. Cut the KV path (the KV-only
drafter's ``inject`` gets zeros, in training and decoding: ``python tests/mutation_kv_cut.py``) and the first
assertion fails: the drafter is then its own control.
"""

import torch
from secret_task import (
    N_FILLERS,
    N_SECRETS,
    drafter_config,
    greedy,
    secret_prompts,
    secret_target,
    sequences,
    trained_kv_drafter,
)

from kvshot_lib.training import EvalSet, collate, evaluate_per_step, with_target_kv

AT_CHANCE = 0.3  # chance is 1/8; the margin covers the sampling noise of 16 held-out prompts


def held_out() -> EvalSet:
    """16 held-out prompts with their continuations; only the secrets of the continuation count."""
    prompts = secret_prompts(2 * N_SECRETS, seed=2)
    seqs = sequences(prompts, greedy(prompts), "real", count="secret")
    batch = collate(seqs, drafter_config("real"))
    with torch.no_grad():
        top = secret_target().model(input_ids=batch.ids).logits.argmax(-1)  # [B, T] the target's greedy token
    return EvalSet([batch], [top])


def step0_accuracy(drafter, evals: EvalSet) -> float:
    ev = evaluate_per_step(drafter, evals, 1)
    assert ev["n_0"] == 2 * N_SECRETS * 6 and ev["ceiling"] == 1.0  # 6 secrets in each 12-token continuation
    return ev["acc_0"]


def test_the_task_is_what_it_says():
    """Greedy continuations are ``0, s, 0, s, ...`` with the prompt's secret ``s``; the target's key is zero
    at every filler and the same at every secret, its value at the secret's position is the secret's one-hot."""
    prompts = secret_prompts(2 * N_SECRETS, seed=2)
    continuations = greedy(prompts)
    for p, c, q in zip(prompts, continuations, sequences(prompts, continuations, "real")):
        at = next(i for i, t in enumerate(p) if t >= N_FILLERS)
        assert c == [0, p[at]] * 6
        fillers = q["input_ids"] < N_FILLERS
        assert float(q["keys.0"][fillers].abs().max()) == 0 and float(q["keys.0"][at].abs().max()) > 1
        assert int(q["values.0"][at, 0].argmax()) == p[at]  # [T, heads, D]: the value names the secret


def test_kv_drafter_learns_what_only_the_target_kv_holds():
    evals = held_out()
    learned = step0_accuracy(trained_kv_drafter("real"), evals)
    assert learned >= 0.9, (
        f"the KV-only drafter did not learn to read the secret from the target's KV: {learned}"
    )
    blind = step0_accuracy(trained_kv_drafter("real"), with_target_kv(evals, "zeroed"))
    assert blind <= AT_CHANCE, f"with the target's K/V zeroed it still knows the secret: {blind}"
    # given the K/V of another prompt (rows rolled by one), it names that prompt's secret
    shuffled = with_target_kv(evals, "shuffled")
    other = step0_accuracy(
        trained_kv_drafter("real"), EvalSet(shuffled.batches, [evals.target_argmax[0].roll(1, 0)])
    )
    assert other >= 0.9, f"it does not read the secret from the K/V it is given: {other}"


def test_zeroed_kv_control_cannot_learn_it():
    acc = step0_accuracy(trained_kv_drafter("zeroed"), held_out())
    assert acc <= AT_CHANCE, f"a drafter without the target's KV guessed the secret: {acc}"
