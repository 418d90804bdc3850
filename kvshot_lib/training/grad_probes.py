"""Gradient probes: how much training signal reaches each part of a drafter (for notebook 05).

Parameter groups, kept separate (:func:`param_group` maps a parameter name to its group):

``kv_proj`` the drafter's own K/V projections · ``q_proj`` its Q projections (self and cross) ·
``o_proj`` its O projections · ``mlp`` · ``fusion`` (the fc over the target's hidden states) ·
``gate`` (the hybrid's gated correction) · ``kv_inject`` (learned maps of the target's KV) · ``norm``.

Per group and probe step (:class:`GradProbe`, after ``backward``, before any gradient scaling or clipping):

* ``l2``: the L2 norm of the group's gradient; ``rms``: its root mean square;
* ``frac_small``: the fraction of entries with ``|g| < rel_threshold * rms(g)`` (default 1e-2);
* ``hoyer``: Hoyer sparsity ``(sqrt(n) - |g|_1/|g|_2) / (sqrt(n) - 1)``, 0 = all equal, 1 = one non-zero;
* ``n_positions``: token positions (one per application of the group's layers: batch row, index, unrolled
  step) whose output received any non-zero gradient, out of ``n_positions_total`` valid ones.

Per own-K/V position (layer, unrolled step the key was made at): the norm of the gradient reaching that
key and value, and the attention it received (summed over heads and every query that saw it), with their
Spearman correlation; plus each segment's share of the attention mass (target KV, own context K/V, own
branch K/V, and the first "sink" key). The softmax weights a key's gradient by the attention it receives, so if the drafter
looks mostly at the target's KV or a sink, its own K/V positions get little gradient.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor, nn

GROUPS = ("kv_proj", "q_proj", "o_proj", "mlp", "fusion", "gate", "kv_inject", "norm")


def param_group(name: str) -> str:
    """The probe group of a drafter parameter (by its ``named_parameters`` name)."""
    if ".mlp." in name:
        return "mlp"
    if name.startswith("fc."):
        return "fusion"
    if ".gate." in name:
        return "gate"
    if ".inject." in name or ".recency." in name:
        return "kv_inject"
    if ".k_proj." in name or ".v_proj." in name:
        return "kv_proj"
    if ".q_proj." in name:
        return "q_proj"
    if ".o_proj." in name:
        return "o_proj"
    if "norm" in name:
        return "norm"
    return "other"


def grouped_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    groups: dict[str, list] = defaultdict(list)
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[param_group(name)].append((name, p))
    return dict(groups)


def grad_stats(grads: list[Tensor], rel_threshold: float = 1e-2) -> dict:
    """L2, RMS, fraction of small entries and Hoyer sparsity of a group's gradient (all entries together)."""
    g = torch.cat([x.detach().float().flatten() for x in grads])
    n = g.numel()
    l2 = g.norm().item()
    l1 = g.abs().sum().item()
    rms = l2 / math.sqrt(n)
    frac_small = (g.abs() < rel_threshold * rms).float().mean().item() if rms > 0 else 1.0
    hoyer = (math.sqrt(n) - l1 / l2) / (math.sqrt(n) - 1) if l2 > 0 and n > 1 else 1.0
    return dict(l2=l2, rms=rms, frac_small=frac_small, hoyer=hoyer, n_params=n)


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (nan if either is constant)."""
    if a.numel() < 3:
        return float("nan")
    ra = a.argsort().argsort().float()
    rb = b.argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = ra.norm() * rb.norm()
    return float((ra @ rb / den).item()) if den > 0 else float("nan")


class GradProbe:
    """Collects one training step's gradient statistics. Use as a context manager around forward+backward.

    It installs forward hooks on the drafter's Linear layers (removed in ``finally``) and is passed to the
    drafter's forward as ``recorder`` so that attention weights and own K/V tensors are recorded.
    """

    def __init__(
        self,
        drafter: nn.Module,
        valid: Tensor,
        rel_threshold: float = 1e-2,
        keep_samples: int = 0,
        branches: Tensor | None = None,
    ):
        self.drafter = drafter
        self.valid = valid  # [B, N] bool: index i is a real branch (i < length - 1)
        B, N = valid.shape
        self._valid_by_len = {
            N: valid,
            N + 1: torch.cat([valid[:, :1], valid], dim=1),
        }  # target KV rows: T = N+1
        if branches is not None and branches.dim() == 1:
            self._valid_by_len.setdefault(len(branches), valid[:, branches])  # steps >= 1: the kept branches
        elif branches is not None:  # [B, M]: per-sequence rows (the block drafter's anchors)
            self._valid_by_len.setdefault(branches.shape[1], valid.gather(1, branches))
        self.rel_threshold = rel_threshold
        self.keep_samples = keep_samples
        self.positions: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # group -> [nonzero, total]
        self.received: dict[tuple, Tensor] = {}
        self.mass: dict[tuple, list[float]] = defaultdict(
            lambda: [0.0, 0.0]
        )  # (segment, layer) -> [mass, sink]
        self.rows: dict[tuple, int] = defaultdict(int)  # (softmax, layer) -> query rows x heads seen
        self.softmax_of: dict[tuple, str] = {}
        self.own: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._handles: list = []

    # -------------------------------------------------------------------------------- recording (forward)

    def __enter__(self):
        for name, mod in self.drafter.named_modules():
            if isinstance(mod, nn.Linear):
                group = param_group(name + ".weight")
                self._handles.append(mod.register_forward_hook(self._linear_hook(group)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _linear_hook(self, group: str):
        def hook(_mod, _inp, out):
            valid = self._valid_by_len.get(out.shape[1]) if out.dim() == 3 else None
            if not out.requires_grad or valid is None or out.shape[0] != valid.shape[0]:
                return

            def count(grad: Tensor):
                nz = (grad.detach().abs().amax(-1) > 0) & valid  # [B, N]
                self.positions[group][0] += int(nz.sum())
                self.positions[group][1] += int(valid.sum())

            out.register_hook(count)

        return hook

    def register_rows(self, valid: Tensor) -> None:
        """Validity ``[B, n]`` of a drafter's own rows of length ``n`` (the block drafter's block rows)."""
        self._valid_by_len[valid.shape[1]] = valid

    def own_kv(self, layer: int, step: int, k: Tensor, v: Tensor) -> None:
        if k.requires_grad:
            k.retain_grad()
            v.retain_grad()
        self.own[(layer, step)] = (k, v)

    def attention(self, segments: list, probs: list[Tensor]) -> None:
        """One softmax's segments and their weights ``[B, kvH, g, n, S]`` (dense) or ``[..., n, 1]`` (diag)."""
        tagged = [(s, p) for s, p in zip(segments, probs) if s.tag is not None]
        if not tagged:
            return
        layer = tagged[0][0].tag[1]
        softmax = "cross" if all(s.tag[0] == "target" for s, _ in tagged) else "self"
        p0 = tagged[0][1]
        self.rows[(softmax, layer)] += p0.shape[0] * p0.shape[1] * p0.shape[2] * p0.shape[3]
        for s, p in tagged:
            tag = s.tag
            if s.kind == "dense":
                rec = p.sum(dim=(1, 2, 3))  # [B, S]: attention received by each key, over heads and queries
            elif s.kind == "block":  # p [B, kvH, g, n, L]: query row r sees key (r // L) * L + j
                B_, _, _, n_, L = p.shape
                rec = p.reshape(B_, -1, n_ // L, L, L).sum(dim=(1, 3)).reshape(B_, n_)  # [B, n]
            else:
                rec = p.sum(dim=(1, 2, 4))  # [B, n]
            if s.rows is not None:  # gathered diag keys: scatter back to the tensor's positions
                full = self.own[(tag[1], tag[2])][0].shape[2]
                rec = rec.new_zeros(rec.shape[0], full).index_add_(1, s.rows, rec)
            self.received[tag] = rec if tag not in self.received else self.received[tag] + rec
            label = "target" if tag[0] == "target" else ("own_context" if s.kind == "dense" else "own_branch")
            m = self.mass[(label, layer)]
            m[0] += float(p.sum())
            m[1] += float(p[..., 0].sum()) if s.kind == "dense" else 0.0
            self.softmax_of[(label, layer)] = softmax

    # ---------------------------------------------------------------------------------- results (backward)

    def group_rows(self) -> list[dict]:
        rows = []
        for group, params in grouped_parameters(self.drafter).items():
            grads = [p.grad for _, p in params if p.grad is not None]
            if not grads:
                continue
            nz, total = self.positions.get(group, (0, 0))
            rows.append(
                dict(
                    group=group,
                    **grad_stats(grads, self.rel_threshold),
                    n_positions=nz,
                    n_positions_total=total,
                )
            )
        return rows

    def kv_rows(self) -> tuple[list[dict], list[dict]]:
        """Per (layer, own step) K/V-position statistics, and raw (received, grad) samples if asked."""
        rows, samples = [], []
        for (layer, step), (k, v) in sorted(self.own.items()):
            if k.grad is None:
                continue
            gk = k.grad.float().pow(2).sum(dim=(1, 3)).sqrt()  # [B, N] per-position key-gradient norm
            gv = v.grad.float().pow(2).sum(dim=(1, 3)).sqrt()  # [B, N]
            rec = self.received.get(("own", layer, step))
            valid = self._valid_by_len[k.shape[2]]
            gk, gv = gk[valid], gv[valid]
            r = rec[valid] if rec is not None else torch.zeros_like(gk)
            rows.append(
                dict(
                    layer=layer,
                    own_step=step,
                    grad_k_mean=float(gk.mean()),
                    grad_v_mean=float(gv.mean()),
                    grad_k_max=float(gk.max()),
                    received_mean=float(r.mean()),
                    spearman_k=spearman(r, gk),
                    spearman_v=spearman(r, gv),
                    frac_zero_grad=float((gk == 0).float().mean()),
                    n_positions=int(gk.numel()),
                )
            )
            if self.keep_samples:
                idx = torch.linspace(0, gk.numel() - 1, min(self.keep_samples, gk.numel())).long()
                samples += [
                    dict(
                        layer=layer,
                        own_step=step,
                        received=float(r[i]),
                        grad_k=float(gk[i]),
                        grad_v=float(gv[i]),
                    )
                    for i in idx.tolist()
                ]
        return rows, samples

    def mass_rows(self) -> list[dict]:
        """Share of attention mass per segment and layer, and of the segment's first ("sink") key.

        Segments: ``target`` (the target's KV), ``own_context`` (the drafter's own K/V of the committed context:
        hidden and hybrid drafters), ``own_branch`` (its own K/V of the branch: the root and drafted tokens)."""
        out = []
        for (label, layer), (mass, sink) in sorted(self.mass.items(), key=lambda x: (x[0][1], x[0][0])):
            n_rows = max(self.rows[(self.softmax_of[(label, layer)], layer)], 1)
            out.append(dict(layer=layer, segment=label, share=mass / n_rows, sink_share=sink / n_rows))
        return out


PROBE_TABLES = ("grad_probes", "kv_positions", "attention_mass", "kv_position_samples")


def load_probe_tables(results_dir) -> dict:
    """The gradient-probe tables notebook 02 wrote to ``results_dir``, as DataFrames."""
    results_dir = Path(results_dir)
    missing = [n for n in PROBE_TABLES if not (results_dir / f"{n}.csv").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{results_dir} lacks {', '.join(m + '.csv' for m in missing)}: these gradient tables are written by "
            "notebook 02 (02_train_drafters.ipynb). Run it first, e.g. `kvshot run --profile <profile> --only 02`."
        )
    return {n: pd.read_csv(results_dir / f"{n}.csv") for n in PROBE_TABLES}


def kv_gradient_summary(tables: dict):
    """Per drafter: how small and how sparse the K/V-projection gradient is next to the other groups.

    Medians over the probe steps of: the kv_proj gradient RMS over the median RMS of the drafter's other
    groups (``kv_rms_vs_others``), its ``frac_small`` and ``hoyer`` next to the other groups' medians, the
    share of positions that sent it any gradient, the mean key-gradient norm at branch positions (made at
    steps >= 1, or the KV-only root) over context positions, the Spearman correlation between attention
    received and key gradient, and the attention share on the drafter's own branch K/V.
    """
    probes, kvp, mass = tables["grad_probes"], tables["kv_positions"], tables["attention_mass"]
    rows = []
    for (name, paradigm, regime), g in probes.groupby(["drafter", "paradigm", "regime"], sort=False):
        per_step = g.pivot_table(index="step", columns="group", values=["rms", "frac_small", "hoyer"])
        others = [c for c in per_step["rms"].columns if c not in ("kv_proj", "norm")]
        kv = g[g["group"] == "kv_proj"]
        k = kvp[kvp["drafter"] == name]
        branch = k[k["own_step"] > 0] if paradigm != "kv" else k
        context = k[k["own_step"] == 0] if paradigm != "kv" else None
        m = mass[(mass["drafter"] == name) & (mass["segment"] == "own_branch")]
        rows.append(
            dict(
                drafter=name,
                paradigm=paradigm,
                regime=regime,
                kv_rms_vs_others=float(
                    (per_step["rms"]["kv_proj"] / per_step["rms"][others].median(axis=1)).median()
                ),
                kv_frac_small=float(per_step["frac_small"]["kv_proj"].median()),
                others_frac_small=float(per_step["frac_small"][others].median(axis=1).median()),
                kv_hoyer=float(per_step["hoyer"]["kv_proj"].median()),
                others_hoyer=float(per_step["hoyer"][others].median(axis=1).median()),
                kv_position_share=float((kv["n_positions"] / kv["n_positions_total"]).median()),
                branch_vs_context_key_grad=(
                    float(branch["grad_k_mean"].median() / context["grad_k_mean"].median())
                    if context is not None and len(context)
                    else float("nan")
                ),
                spearman_received_vs_grad=float(k["spearman_k"].median()),
                attention_on_own_branch=float(m["share"].median()) if len(m) else float("nan"),
            )
        )
    return pd.DataFrame(rows)
