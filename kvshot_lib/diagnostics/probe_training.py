"""Training and testing the information probes (:mod:`.info_probes`) on :class:`~.probe_data.ProbeData`.

* :class:`ProbeBatch`: a few whole documents with all their anchors (the KV probes attend over each
  document's own K/V), with labels as indices into the readout vocabulary (-1: outside it, ignored);
* :func:`control_labels`: the control task, a random label per token type (the token at ``t``), drawn
  from the real labels' frequencies, one map per step: a probe that merely memorizes token identities
  does as well on it, so ``selectivity = top-1(real) - top-1(control)``;
* :func:`train_probes`: one bank per kind and seed, AdamW with a cosine schedule, the K probes' mean
  cross-entropies summed (independent probes);
* :func:`test_rows`: per test document, step and probe, the summed cross-entropy (bits), top-1 and top-5
  hits and the example count: the unit the paired bootstrap of :mod:`.probe_stats` resamples;
* :func:`run_probes`: all of it for a :class:`ProbeConfig` (what notebook 01 calls). Only the readout
  vocabulary's labels count (the ``readout_size`` most frequent labels of the training documents; the share of
  test labels it covers is reported), so cross-entropies are over that vocabulary, the same for every probe.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from torch.nn import functional as F
from tqdm.auto import tqdm

from ..corpus import tokenize_sharegpt
from ..corpus.sharegpt import DEFAULT_EVAL_SIZE
from ..target.precision import autocast, machine_record, resolve_precision
from .info_probes import KINDS, ProbeBank, ProbeDims, Readout, probe_widths
from .probe_data import ProbeData, probe_documents


class ProbeBatch:
    """Whole documents of a :class:`ProbeData`, as float32 tensors; ``n`` examples (anchors) in all."""

    def __init__(
        self, docs, embed_weight: Tensor, rope_fn, dims: ProbeDims, label_index: Tensor, device="cpu"
    ):
        self.dims, self.device = dims, torch.device(device)
        self.doc_ids = [d.doc_id for d in docs]
        self.tokens = torch.cat([d.tokens for d in docs])  # [n] on the CPU (the control task's key)
        self.labels = label_index[torch.cat([d.labels for d in docs], dim=1)].to(device)  # [K, n], -1 outside
        self.anchors = torch.cat([d.anchors for d in docs]).to(device)  # [n]
        self.doc_of = torch.cat([torch.full((d.anchors.numel(),), i) for i, d in enumerate(docs)]).to(device)
        self.hidden = torch.cat([d.hidden for d in docs]).float().to(device)  # [n, nL*H]
        self.embedding = F.embedding(self.tokens, embed_weight).float().to(device)  # [n, H]
        self.queries = torch.cat([d.queries for d in docs], dim=1).float().to(device)  # [K, n, heads, D]
        K = self.queries.shape[0]
        pos = (
            self.anchors[None] + torch.arange(K, device=device)[:, None]
        )  # [K, n] positions t+k of the queries
        cos, sin = rope_fn(pos.flatten())  # [K*n, D]
        self.rope = (cos.view(K, -1, 1, dims.head_dim), sin.view(K, -1, 1, dims.head_dim))
        self.kv = [(d.keys.to(device), d.values.to(device)) for d in docs]  # [nI, T', D]
        self.rows = np.cumsum([0] + [d.anchors.numel() for d in docs])
        self._oracle: Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.anchors.numel())

    def hidden_normed(self) -> Tensor:
        nL, H = self.dims.n_layers, self.dims.hidden
        return F.layer_norm(self.hidden.view(-1, nL, H), (H,)).view(-1, nL * H)  # [n, nL*H]

    def oracle_read(self) -> Tensor:
        """What the target's own queries at ``t+k`` read from K/V ``0..t`` (no parameters: computed once)."""
        if self._oracle is None:
            with torch.no_grad():
                self._oracle = self.attend(self.queries)
        return self._oracle

    def attend(self, q: Tensor) -> Tensor:
        """Each example's queries ``[K, n, heads, D]`` over its document's K/V of positions ``0..t``."""
        K, n, heads, D = q.shape
        out = []
        for i, (keys, values) in enumerate(self.kv):
            r0, r1 = self.rows[i], self.rows[i + 1]
            g = heads // keys.shape[0]
            k_ = keys.repeat_interleave(g, 0)  # [heads, T', D]
            v_ = values.repeat_interleave(g, 0)
            a = r1 - r0
            qh = q[:, r0:r1].permute(2, 0, 1, 3).reshape(heads, K * a, D)  # [heads, K*a, D]
            s = torch.bmm(qh, k_.transpose(1, 2)) * D**-0.5  # [heads, K*a, T']
            later = torch.arange(k_.shape[1], device=k_.device)[None] > self.anchors[r0:r1, None]  # [a, T']
            s = s.view(heads, K, a, -1).masked_fill(later, float("-inf")).view(heads, K * a, -1)
            o = torch.bmm(torch.softmax(s, -1), v_)  # [heads, K*a, D]
            out.append(o.view(heads, K, a, D).permute(1, 2, 0, 3))  # [K, a, heads, D]
        read = torch.cat(out, dim=1)
        return F.layer_norm(read, (D,)).reshape(K, n, heads * D)


def readout_vocab(data: ProbeData, size: int) -> Tensor:
    """The ``size`` most frequent labels of the training documents (ties by token id): the readout vocabulary."""
    labels = torch.cat([d.labels.flatten() for d in data.docs])
    ids, counts = torch.unique(labels, return_counts=True)
    order = sorted(range(len(ids)), key=lambda i: (-int(counts[i]), int(ids[i])))[:size]
    return ids[sorted(order)]


def label_index(vocab: Tensor, vocab_size: int) -> Tensor:
    """A lookup table target id -> index in ``vocab`` (-1 for every other id)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return index


def control_maps(batches: list[ProbeBatch], vocab_size: int, seed: int) -> list[Tensor]:
    """The control task: per step ``k`` a random map ``π_k`` from token types (the token at ``t``) to readout
    labels ``[vocab_size]``, drawn from the real labels' frequencies in ``batches`` (the training set)."""
    real = torch.cat([b.labels.cpu() for b in batches], dim=1)  # [K, N]
    g = torch.Generator().manual_seed(seed)
    maps = []
    for k in range(real.shape[0]):
        valid = real[k][real[k] >= 0]
        maps.append(valid[torch.randint(0, valid.numel(), (vocab_size,), generator=g)])  # [vocab]
    return maps


def control_labels(maps: list[Tensor], batches: list[ProbeBatch]) -> list[Tensor]:
    """The control labels ``[K, n]`` of every batch: ``π_k(token at t)``."""
    return [torch.stack([m[b.tokens] for m in maps]).to(b.device) for b in batches]


def batches_of(data: ProbeData, target, label_idx: Tensor, docs_per_batch: int) -> list[ProbeBatch]:
    model = target.model
    embed = model.model.embed_tokens.weight.detach().float().cpu()
    rotary = model.model.rotary_emb
    device = embed_device = model.model.embed_tokens.weight.device

    def rope_fn(pos: Tensor):
        x = torch.zeros(1, dtype=torch.float32, device=embed_device)
        with torch.no_grad():
            cos, sin = rotary(x, pos[None].to(embed_device))
        return cos[0].float(), sin[0].float()

    dims = probe_dims(data)
    docs = data.docs
    return [
        ProbeBatch(docs[i : i + docs_per_batch], embed, rope_fn, dims, label_idx, device)
        for i in range(0, len(docs), docs_per_batch)
    ]


def probe_dims(data: ProbeData) -> ProbeDims:
    return ProbeDims(len(data.layers), data.hidden_size, data.n_heads, data.n_kv_heads, data.head_dim)


def _loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum over steps of each step's mean cross-entropy (nats) over its in-vocabulary examples."""
    K = logits.shape[0]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none").view(K, -1)
    ok = labels >= 0
    return ((ce * ok).sum(1) / ok.sum(1).clamp(min=1)).sum()


def train_bank(
    kind: str,
    batches: list[ProbeBatch],
    readout: Readout,
    dims: ProbeDims,
    width: int,
    rank: int,
    seed: int,
    epochs: int,
    lr: float,
    weight_decay: float = 0.01,
    labels: list[Tensor] | None = None,
    init_bias: Tensor | None = None,
    progress: bool = False,
    precision: str = "no",
) -> ProbeBank:
    """Train one bank (``K`` probes of ``kind``) on ``batches``; ``labels`` replaces the real labels (control).
    ``precision`` (resolved: ``"no"`` or ``"bf16"``) is the autocast of the forward; losses are in float32."""
    K = batches[0].labels.shape[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bank = ProbeBank(kind, K, dims, width, rank, readout, init_bias)
    bank = bank.to(batches[0].device)  # initialized on the CPU: the seed fixes it on any device
    opt = torch.optim.AdamW(
        [p for p in bank.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay
    )
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    rng = np.random.default_rng(seed)
    bank.train()
    for _ in tqdm(range(epochs), desc=f"{kind} seed {seed}", leave=False, disable=not progress):
        for b in rng.permutation(len(batches)):
            target = batches[b].labels if labels is None else labels[b]
            with autocast(precision, batches[b].device):
                logits = bank(batches[b])
            loss = _loss(logits.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    bank.eval()
    return bank


@torch.no_grad()
def test_rows(
    bank: ProbeBank, batches: list[ProbeBatch], labels: list[Tensor] | None = None, precision: str = "no"
) -> list[dict]:
    """Per test document and step: ``n``, summed cross-entropy in bits, top-1 and top-5 hits."""
    rows = []
    for bi, b in enumerate(batches):
        with autocast(precision, b.device):
            logits = bank(b).float()  # [K, n, V]
        y = b.labels if labels is None else labels[bi]
        ok = y >= 0
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none").view_as(y)
        top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # [K, n, 5]
        hit1 = top5[..., 0] == y
        hit5 = (top5 == y[..., None]).any(-1)
        for d, doc_id in enumerate(b.doc_ids):
            sel = (b.doc_of == d)[None] & ok  # [K, n]
            for k in range(y.shape[0]):
                m = sel[k]
                if bool(m.any()):
                    rows.append(
                        dict(
                            doc=doc_id,
                            step=k,
                            n=int(m.sum()),
                            ce_bits=float(ce[k][m].sum()) / math.log(2),
                            top1=int(hit1[k][m].sum()),
                            top5=int(hit5[k][m].sum()),
                        )
                    )
    return rows


def train_probes(
    train: list[ProbeBatch],
    test: list[ProbeBatch],
    readout: Readout,
    dims: ProbeDims,
    widths: dict[str, int],
    rank: int,
    kinds,
    seeds,
    epochs: int,
    lr: float,
    vocab_size: int,
    init_bias: Tensor | None = None,
    control_kinds=(),
    control_seed: int = 12345,
    progress: bool = True,
    precision: str = "no",
) -> pd.DataFrame:
    """Every kind x seed on the real task, and ``control_kinds`` on the control task (first seed): the
    per-document test table (columns ``kind, task, seed, doc, step, n, ce_bits, top1, top5``)."""
    maps = control_maps(train, vocab_size, control_seed)
    c_train, c_test = control_labels(maps, train), control_labels(maps, test)
    jobs = [(k, "real", s) for k in kinds for s in seeds] + [(k, "control", seeds[0]) for k in control_kinds]
    rows = []
    for kind, task, seed in tqdm(jobs, desc="probes", disable=not progress):
        ctrl = task == "control"
        bank = train_bank(
            kind,
            train,
            readout,
            dims,
            widths[kind],
            rank,
            seed,
            epochs,
            lr,
            labels=c_train if ctrl else None,
            precision=precision,
        )
        for r in test_rows(bank, test, c_test if ctrl else None, precision):
            rows.append(dict(kind=kind, task=task, seed=seed, params=bank.n_trainable_per_probe(), **r))
    return pd.DataFrame(rows)


@dataclass
class ProbeConfig:
    """Everything notebook 01 sets; :meth:`validate` names a bad field before any work."""

    layers: tuple[int, ...]
    n_train_docs: int = 80
    n_test_docs: int = 32
    offset: int = 100  # eval-split conversations skipped (notebook 02 evaluates on the first ones)
    max_len: int = 256
    anchors_per_doc: int = 160
    n_steps: int = 8
    readout_size: int = 512
    budget: int = 100_000
    query_rank: int = 16
    kinds: tuple[str, ...] = KINDS
    control_kinds: tuple[str, ...] = ("h", "kv_h")
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 2
    lr: float = 3e-3
    docs_per_batch: int = 1
    data_seed: int = 0
    mixed_precision: str = "auto"  # the probes' forward: bf16 where the device has it (target/precision.py)

    def validate(self) -> ProbeConfig:
        ints = (
            "n_train_docs",
            "n_test_docs",
            "max_len",
            "anchors_per_doc",
            "n_steps",
            "readout_size",
            "budget",
            "query_rank",
            "epochs",
            "docs_per_batch",
        )
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"probe parameter {name} must be a positive integer, got {v!r}.")
        bad = [k for k in (*self.kinds, *self.control_kinds) if k not in KINDS]
        if bad or "emb" not in self.kinds or "h" not in self.kinds:
            raise ValueError(
                f"probe kinds must come from {KINDS} and include 'emb' and 'h'; got {list(self.kinds)}."
            )
        if not self.seeds:
            raise ValueError("give at least one probe seed.")
        if self.offset + self.n_train_docs + self.n_test_docs > DEFAULT_EVAL_SIZE:
            raise ValueError(
                f"offset + train + test documents = {self.offset + self.n_train_docs + self.n_test_docs} exceeds the "
                f"{DEFAULT_EVAL_SIZE} conversations of ShareGPT's held-out split (the only text no drafter trains on)."
            )
        return self


@dataclass
class ProbeRun:
    table: pd.DataFrame  # per test document: kind, task, seed, doc, step, n, ce_bits, top1, top5
    params: pd.DataFrame  # per kind: MLP width, trainable parameters per probe, deviation from the budget
    data: dict  # documents, examples, readout vocabulary and its coverage


def run_probes(target, cfg: ProbeConfig, progress: bool = True) -> ProbeRun:
    """Extract the probe data from held-out ShareGPT documents, train every probe, test it (module doc)."""
    cfg.validate()
    precision = resolve_precision(cfg.mixed_precision, target.info.device)  # before any work
    split = tokenize_sharegpt(
        target.tokenizer,
        "eval",
        cfg.n_train_docs + cfg.n_test_docs,
        cfg.max_len,
        seed=cfg.data_seed,
        offset=cfg.offset,
    )
    data = probe_documents(target, split, cfg.layers, cfg.n_steps, cfg.anchors_per_doc, progress)
    cut = min(cfg.n_train_docs, len(data.docs) - 1)
    train, test = (
        dataclasses.replace(data, docs=data.docs[:cut]),
        dataclasses.replace(data, docs=data.docs[cut:]),
    )
    vocab = readout_vocab(train, cfg.readout_size)
    idx = label_index(vocab, target.info.vocab_size)
    train_b, test_b = (
        batches_of(train, target, idx, cfg.docs_per_batch),
        batches_of(test, target, idx, cfg.docs_per_batch),
    )
    dims = probe_dims(data)
    widths = probe_widths(dims, cfg.budget, cfg.query_rank)
    readout = Readout(target, vocab)
    table = train_probes(
        train_b,
        test_b,
        readout,
        dims,
        widths,
        cfg.query_rank,
        cfg.kinds,
        cfg.seeds,
        cfg.epochs,
        cfg.lr,
        target.info.vocab_size,
        train.mean_final,
        cfg.control_kinds,
        progress=progress,
        precision=precision,
    )
    counts = table.drop_duplicates("kind").set_index("kind")["params"]
    params = pd.DataFrame(
        [
            dict(
                kind=k,
                mlp_width=widths[k],
                params=int(counts[k]),
                budget=cfg.budget,
                deviation=int(counts[k]) / cfg.budget - 1,
            )
            for k in cfg.kinds
        ]
    )
    coverage = lambda bs: float(torch.cat([b.labels for b in bs], 1).ge(0).float().mean())  # noqa: E731
    info = dict(
        layers=list(cfg.layers),
        train_docs=len(train.docs),
        test_docs=len(test.docs),
        train_examples=train.n_examples,
        test_examples=test.n_examples,
        readout_vocab=int(vocab.numel()),
        train_coverage=coverage(train_b),
        test_coverage=coverage(test_b),
        source="ShareGPT V3 held-out split",
        offset=cfg.offset,
        max_len=cfg.max_len,
        n_steps=cfg.n_steps,
        **machine_record(precision, target.info.device),
    )
    return ProbeRun(table, params, info)
