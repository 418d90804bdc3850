"""The data of the information probes: what the target holds at an anchor ``t``, and its greedy tokens after it.

Documents are ShareGPT conversations of the held-out ``eval`` split (:func:`~kvshot_lib.corpus.split_indices`),
which no drafter trains on, from ``offset`` on (past the slice notebook 02 evaluates on); the probes' training
and test documents are disjoint slices of it, so the split is by document. For each document the target runs
once (:func:`~kvshot_lib.target.capture`) and keeps, for the probe layers:

* ``hidden [A, nL*H]``: the hidden states (outputs of the layers, side by side) at the anchors;
* ``keys/values [nI, T', D]``: the layers' post-RoPE K/V (KV heads side by side) up to the last anchor;
* ``queries [K, A, nL*Hq, D]``: the target's post-RoPE queries at ``t+k`` (the oracle probe's queries);
* ``labels [K, A]``: the target's greedy token after position ``t+k`` on the real prefix, i.e. its choice for
  the token at ``t+1+k``;
* ``tokens [A]``: the token at ``t`` (the embedding-only probe's input and the control task's key).

Anchors are assistant positions with ``K`` labels after them, at most ``anchors_per_doc`` per document,
evenly spread. Everything is kept in float32 (a few MB per document for one probe layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..corpus import TokenizedSplit
from ..target.forward import sequence_features


@dataclass
class ProbeDoc:
    doc_id: str
    anchors: Tensor  # [A] positions t
    tokens: Tensor  # [A] token at t
    labels: Tensor  # [K, A] target greedy token for position t+1+k
    hidden: Tensor  # [A, nL*H]
    keys: Tensor  # [nI, T', D]
    values: Tensor  # [nI, T', D]
    queries: Tensor  # [K, A, nL*Hq, D]


@dataclass
class ProbeData:
    docs: list[ProbeDoc]
    layers: tuple[int, ...]
    n_steps: int
    n_heads: int  # target query heads per layer
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    mean_final: Tensor | None = None  # [H] mean direction of the target's final hidden state before its norm

    @property
    def n_examples(self) -> int:
        return int(sum(d.anchors.numel() for d in self.docs))

    def label_vocab(self) -> Tensor:
        """Every target token that is some example's label, sorted: the probes' readout vocabulary."""
        return torch.unique(torch.cat([d.labels.flatten() for d in self.docs]))


def pick_probe_anchors(loss_mask: Tensor, n_steps: int, per_doc: int) -> Tensor:
    """Assistant positions ``t >= 1`` with ``t + n_steps`` inside the document, evenly thinned to ``per_doc``."""
    T = loss_mask.numel()
    ok = loss_mask.clone()
    ok[0] = False
    ok[max(T - n_steps, 0) :] = False
    anchors = torch.nonzero(ok).flatten()
    if anchors.numel() > per_doc:
        anchors = anchors[torch.linspace(0, anchors.numel() - 1, per_doc).round().long()]
    return anchors


@torch.no_grad()
def probe_documents(
    target, split: TokenizedSplit, layers, n_steps: int, anchors_per_doc: int, progress: bool = True
) -> ProbeData:
    """Run the target over every document of ``split`` and keep the probes' inputs and labels (module doc)."""
    layers = tuple(int(x) for x in layers)
    info = target.info
    bad = [x for x in layers if not 0 <= x < info.n_layers]
    if bad:
        raise ValueError(f"probe layers {bad} are outside the target's 0..{info.n_layers - 1}.")
    dev = next(target.model.parameters()).device
    docs = []
    steps = torch.arange(n_steps)
    final_sum, n_final = torch.zeros(info.hidden_size), 0
    for ids, mask, doc_id in tqdm(
        list(zip(split.ids, split.loss_mask, split.source_ids)), desc="probe data", disable=not progress
    ):
        anchors = pick_probe_anchors(mask, n_steps, anchors_per_doc)
        if anchors.numel() == 0:
            continue
        f = sequence_features(target.model, ids[None], layers, layers, query_layers=layers, logits=True)
        greedy = f.logits[0].argmax(-1).cpu()  # [T]: the target's choice for the next position
        pos = anchors[None] + steps[:, None]  # [K, A] positions t+k
        final = f.final[0, pos.flatten().to(dev)].float().cpu()  # [K*A, H] post-norm
        final_sum, n_final = final_sum + final.sum(0), n_final + final.shape[0]
        end = int(anchors.max()) + 1
        keys = torch.cat([f.keys[x][0, :, :end] for x in layers])  # [nI, T', D]
        values = torch.cat([f.values[x][0, :, :end] for x in layers])
        queries = torch.cat([f.queries[x][0] for x in layers])  # [nL*Hq, T, D]
        docs.append(
            ProbeDoc(
                doc_id=str(doc_id),
                anchors=anchors,
                tokens=ids[anchors],
                labels=greedy[pos],
                hidden=torch.cat([f.hidden[x][0, anchors] for x in layers], dim=-1).float().cpu(),
                keys=keys.float().cpu(),
                values=values.float().cpu(),
                queries=queries[:, pos].permute(1, 2, 0, 3).float().cpu(),  # [K, A, nL*Hq, D]
            )
        )
    return ProbeData(docs, layers, n_steps, info.n_heads, info.n_kv_heads, info.head_dim, info.hidden_size)
