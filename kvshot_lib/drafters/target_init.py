"""Target initialization of the KV-only drafter's attention: its projections start as the target's own.

The paper names query estimation as the KV drafter's bottleneck: a shallow drafter must learn queries that
find, in the target's cached keys, what the target's own queries would. :func:`init_attention_from_target`
attacks that directly (``init_from: target``, the reference run's ``kv-ttt-tinit`` row). For every drafter
layer and every target layer ``l`` whose KV it reads (injected heads ``l`` side by side, see ``kv.py``):

* the query rows of drafter head ``(l, h, g)`` are the target layer ``l``'s query rows of its head
  ``h * G + g`` (``G`` the target's GQA group), the key and value rows of injected head ``(l, h)`` are
  layer ``l``'s key and value rows of KV head ``h``, and the output columns of ``(l, h, g)`` are layer
  ``l``'s, divided by how many of the drafter's heads reuse that target head's columns and by the number of
  target layers (the drafter sums every layer's attention where the target has one per layer);
* the target's input RMSNorm weight of layer ``l`` is folded into those rows, and the drafter's input norm
  starts at ones, so that on the target's own normalized input the drafter's post-RoPE queries and keys
  *are* the target's (``tests/test_target_init.py`` checks exactly that against captured queries).

The MLP, the recency bias and the injector keep their own initialization.

The drafter's input is its own, though, not the target layer's: on SmolLM2 the initialized drafter's queries have
a cosine of 0.005 with the target's at step 0, and 0.276 once trained, against 0.290 for the same drafter
trained from a random start (reference run, ``figures/reference/data/partial/kv-ttt-tinit_query_error.csv``).
"""

from __future__ import annotations

import torch

from ..target import Target, decoder_layers
from .config import DrafterConfigError
from .kv import KVDrafter


@torch.no_grad()
def init_attention_from_target(drafter: KVDrafter, target: Target) -> dict:
    """Copy the target's attention into a KV-only drafter (module doc); returns what was initialized."""
    cfg = drafter.cfg
    if cfg.paradigm != "kv":
        raise DrafterConfigError(
            f"init_from='target' initializes a KV-only drafter's attention from the target layers it reads; "
            f"the {cfg.paradigm} drafter has no such attention."
        )
    info, D, qg = target.info, cfg.target_head_dim, cfg.query_group
    kvh, group = info.n_kv_heads, info.n_heads // info.n_kv_heads
    uses = -(-qg // group)  # drafter heads sharing one target head's output columns
    layers = decoder_layers(target.model)
    for layer in drafter.layers:
        attn = layer.self_attn
        for j, li in enumerate(cfg.kv_layers):
            t = layers[li].self_attn
            norm = layers[li].input_layernorm.weight.float()  # [H]
            wq, wk, wv = (p.weight.float() * norm for p in (t.q_proj, t.k_proj, t.v_proj))  # [out, H]
            wo = t.o_proj.weight.float()  # [H, nH*D]
            for h in range(kvh):
                dk = j * kvh + h  # the drafter's injected head
                attn.k_proj.weight[dk * D : (dk + 1) * D] = wk[h * D : (h + 1) * D]
                attn.v_proj.weight[dk * D : (dk + 1) * D] = wv[h * D : (h + 1) * D]
                for g in range(qg):
                    tq, dq = h * group + g % group, dk * qg + g  # target / drafter query head
                    attn.q_proj.weight[dq * D : (dq + 1) * D] = wq[tq * D : (tq + 1) * D]
                    attn.o_proj.weight[:, dq * D : (dq + 1) * D] = wo[:, tq * D : (tq + 1) * D] / (
                        uses * len(cfg.kv_layers)
                    )
        layer.input_norm.weight.fill_(1.0)
    return dict(source="target", layers=list(cfg.kv_layers), parts=["q_proj", "k_proj", "v_proj", "o_proj"])
