"""A task that only the target's KV can solve, on a hand-built one-layer target (shared by
``test_kv_copy_task.py`` and ``test_decoding.py``).

**The target.** Vocabulary: fillers ``0..15`` and secrets ``16..23``; a prompt holds fillers ``1..15`` and one
secret early on. Greedy decoding continues ``0, s, 0, s, ...``: after filler 0 the target says the secret
``s`` of its context, after anything else it says 0. Its weights are set by hand (no training, no seed):

* embedding: a one-hot of the token (dims ``0..23``), a constant 1 (``BIAS``), an is-a-secret flag
  (``SECRET``) and an is-filler-0 flag (``ZERO``);
* attention: every query ``q = 4 * BIAS`` meets the key ``k = 4 * SECRET`` in the slowest RoPE pair (dims 31
  and 63, which turn by ~1e-4 rad per position), so every position attends to the secret(s) of its
  context and reads their one-hot through the value (``o_proj``: x4);
* LM head: the one-hot of the token, plus ``20 * BIAS - 40 * ZERO`` on token 0, so token 0 wins unless the
  current token is 0, when the secret read by the attention wins. The MLP is zero.

So the secret's identity is in the target's K/V at its position. A drafter that must say the secret after
filler 0 sees only the root (0) and its own drafts through its own attention: the KV-only drafter can
learn it only from the target's K/V, and its zeroed-KV control can only guess (1 in 8).
"""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate
from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.target import Target, TargetInfo
from kvshot_lib.training import Objective, TrainConfig, build_optimizer, collate, target_sequence

N_FILLERS, N_SECRETS = 16, 8
V, H = N_FILLERS + N_SECRETS, 64
BIAS, SECRET, ZERO, MARK = V, V + 1, V + 2, 31
PROMPT_LEN, NEW_TOKENS = 12, 12
TRAIN_STEPS = 80  # held-out step-0 accuracy reaches 1.0 by ~60 steps; the zeroed control stays near 1/8


@functools.cache
def secret_target() -> Target:
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=H,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        tokens = torch.arange(V)
        emb = model.model.embed_tokens.weight  # [V, H]
        emb[tokens, tokens] = 1.0
        emb[:, BIAS] = 1.0
        emb[N_FILLERS:, SECRET] = 1.0
        emb[0, ZERO] = 1.0
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight[MARK, BIAS] = 4.0
        attn.k_proj.weight[MARK, SECRET] = 4.0
        attn.v_proj.weight[tokens, tokens] = 1.0
        attn.o_proj.weight[tokens, tokens] = 4.0
        layer = model.model.layers[0]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        head = model.lm_head.weight  # [V, H]
        head[tokens, tokens] = 1.0
        head[0, BIAS], head[0, ZERO] = 20.0, -40.0
    model.config._attn_implementation = "sdpa"
    model.eval().requires_grad_(False)
    info = TargetInfo(
        name="secret-copy",
        family="llama",
        n_layers=1,
        hidden_size=H,
        n_heads=1,
        n_kv_heads=1,
        head_dim=H,
        vocab_size=V,
        max_context=256,
        eos_token_ids=(),
        dtype="float32",
        device="cpu",
        n_params=sum(p.numel() for p in model.parameters()),
        fingerprint="hand-built-secret-copy",
    )
    return Target(model, None, info)


def secret_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of fillers ``1..15`` with secret ``16 + i % 8`` at one of the first 4 positions."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        ids = torch.randint(1, N_FILLERS, (PROMPT_LEN,), generator=g)
        ids[int(torch.randint(0, 4, (1,), generator=g))] = N_FILLERS + i % N_SECRETS
        prompts.append(ids.tolist())
    return prompts


def greedy(prompts: list[list[int]]) -> list[list[int]]:
    cfg = DecodeConfig(mode="ar", max_new_tokens=NEW_TOKENS, stop_token_ids=())
    return [autoregressive_generate(secret_target(), p, cfg).token_ids for p in prompts]


def drafter_config(target_kv: str):
    return drafter_config_for(
        secret_target(), "kv", kv_layers=(0,), draft_vocab_size=V, regime="ttt", target_kv=target_kv
    )


def sequences(prompts, continuations, target_kv: str, count: str = "continuation") -> list[dict]:
    """Feature-store sequences (prompt + greedy continuation, the target's real K/V and labels). A token
    counts (``loss_mask``) if it is in the continuation, or with ``count="secret"`` only if it is a secret
    there, i.e. one that the target says after filler 0."""
    cfg, seqs = drafter_config(target_kv), []
    for p, c in zip(prompts, continuations):
        ids = torch.tensor(p + c)
        counted = torch.arange(len(ids)) >= len(p)
        if count == "secret":
            counted &= ids >= N_FILLERS
        seqs.append(target_sequence(secret_target(), ids, counted, cfg))
    return seqs


@functools.cache
def trained_kv_drafter(target_kv: str):
    """A KV-only drafter trained through the real objective on 48 prompts and their greedy continuations
    (TTT, 3 steps; ``build_optimizer``; clipping as in ``training.loop``); ``target_kv="zeroed"``: the control."""
    prompts = secret_prompts(48, seed=1)
    seqs = sequences(prompts, greedy(prompts), target_kv)
    cfg = TrainConfig(
        paradigm="kv",
        regime="ttt",
        ttt_steps=3,
        kv_layers=[0],
        draft_vocab_size=V,
        lr=3e-3,
        target_kv=target_kv,
    )
    d = build_drafter(drafter_config(target_kv), secret_target(), torch.arange(V), seed=0)
    objective, optimizer = Objective(d, cfg), build_optimizer(d, cfg)
    g = torch.Generator().manual_seed(3)
    d.train()
    for _ in range(TRAIN_STEPS):
        batch = collate([seqs[i] for i in torch.randint(0, len(seqs), (8,), generator=g)], d.cfg)
        loss, _ = objective(batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.grad_clip)
        optimizer.step()
    return d.eval()
