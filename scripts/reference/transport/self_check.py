"""A one-minute check, at stage time, that this machine's torch and transformers run the suite as this one does.

The GPU image may carry other versions than the machine that wrote the code. Before any job spends minutes,
:func:`self_check` loads the staged target on the job's device and checks, on a real prompt:

* the capture hooks: hidden states equal ``output_hidden_states``, captured K/V equal the cache's;
* a drafter step: a fresh hidden-only drafter's session logits equal its training unroll's;
* batched greedy decoding (regeneration, MT-bench references) equals plain greedy decoding (in bf16 a near-tie
  may round the other way under padding: reported, not required).

It prints one line per check and returns them; a failure names what differs (stage records it in READY.json).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def self_check(device: str = "cuda", dtype: str = "bfloat16") -> dict:
    from kvshot_lib.corpus import batched_greedy, chat_prompt_ids
    from kvshot_lib.decoding import DecodeConfig, autoregressive_generate
    from kvshot_lib.drafters import TargetView, build_drafter, drafter_config_for
    from kvshot_lib.target import capture, load_target
    from kvshot_lib.training import batch_from_target

    if device.startswith("cuda") and not torch.cuda.is_available():
        device, dtype = "cpu", "float32"
    target = load_target("smollm2-135m", device=device, dtype=dtype)
    tok = target.tokenizer
    ids = chat_prompt_ids(
        tok, [{"role": "user", "content": "Explain what a KV cache holds, in two sentences."}]
    )
    x = torch.tensor([ids], device=target.model.device)  # [1, T]
    checks = {}
    layers = list(target.info.default_hidden_layers())
    with capture(target.model, layers) as rec:
        out = target.model(input_ids=x, use_cache=True, output_hidden_states=True)
    hid = max(float((rec.hidden_at(i) - out.hidden_states[i + 1]).abs().max()) for i in layers)
    kv = max(float((rec.keys_at(i) - out.past_key_values.layers[i].keys).abs().max()) for i in layers)
    checks["capture"] = dict(ok=hid == 0.0 and kv == 0.0, hidden_max_diff=hid, keys_max_diff=kv)
    cfg = drafter_config_for(target, "hidden", draft_vocab_size=2048)
    d = build_drafter(cfg, target, torch.arange(2048) * 7, seed=0).eval()
    ids_t = torch.tensor(ids)
    un = d(batch_from_target(target, ids_t, torch.ones(len(ids), dtype=torch.bool), cfg), 2)
    s = d.new_session()
    P = len(ids) - 1
    hidden = {i: out.hidden_states[i + 1][:, :P].float() for i in layers}
    short = target.model(input_ids=x[:, :P], use_cache=True)
    root = s.start_cycle(x, TargetView(cache=short.past_key_values, hidden=hidden))
    diff = float((root - d.logits(un.outs[0][0, P - 1])).abs().max())
    checks["drafter_session"] = dict(ok=diff < (1e-3 if dtype == "float32" else 2e-2), max_diff=diff)
    prompts = [ids, ids[: len(ids) // 2]]
    batched = batched_greedy(target, prompts, 12, stop=False)
    plain = [
        autoregressive_generate(
            target, p, DecodeConfig(mode="ar", max_new_tokens=12, stop_token_ids=())
        ).token_ids
        for p in prompts
    ]
    same = sum(a == b for bb, pp in zip(batched, plain) for a, b in zip(bb, pp))
    checks["batched_greedy"] = dict(ok=batched == plain, same_tokens=same, of=24)
    for name, c in checks.items():
        print(f"self-check {name}: {'ok' if c['ok'] else 'DIFFERS'} {c}")
    # batched greedy may part from plain greedy at a near-tie in bf16 (padding changes the rounding): reported only
    ok = checks["capture"]["ok"] and checks["drafter_session"]["ok"]
    return dict(device=device, dtype=dtype, checks=checks, ok=ok)
