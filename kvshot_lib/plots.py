"""Figures of the target and data notebook, and the one way every notebook saves a figure (PNG + PDF)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np


def save_figure(fig, figure_dir: str | Path, name: str) -> list[Path]:
    """Write ``fig`` as ``<figure_dir>/<name>.png`` (150 dpi) and ``.pdf``; returns both paths."""
    figure_dir = Path(figure_dir)
    figure_dir.mkdir(parents=True, exist_ok=True)
    paths = [figure_dir / f"{name}.png", figure_dir / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    return paths


def plot_length_distributions(
    conversation_tokens, response_tokens, max_context: int | None = None, title: str = "ShareGPT V3"
):
    """Histograms (log-spaced bins) of conversation and assistant-response lengths in tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, values, what in (
        (axes[0], conversation_tokens, "conversation"),
        (axes[1], response_tokens, "assistant response"),
    ):
        values = np.asarray(values)
        bins = np.logspace(0, np.log10(max(values.max(), 10)), 40)
        ax.hist(values, bins=bins, color="#4C72B0", alpha=0.85)
        ax.set_xscale("log")
        ax.axvline(np.median(values), color="k", ls="--", lw=1, label=f"median {np.median(values):.0f}")
        if max_context and what == "conversation":
            ax.axvline(max_context, color="#C44E52", lw=1, label=f"max context {max_context}")
        ax.set_xlabel(f"{what} length (tokens)")
        ax.set_ylabel("count")
        ax.set_title(f"{title}: {what}s (n={len(values)})")
        ax.legend(frameon=False)
    fig.tight_layout()
    return fig
