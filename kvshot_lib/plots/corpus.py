"""Figures of the target-and-data notebook (00), drawn from its saved tables."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .style import PAGE, PARADIGM_COLORS, finish_figure


def plot_length_distributions(
    conversations: pd.DataFrame, responses: pd.DataFrame, max_context: int | None = None
):
    """Histograms (log-spaced bins) of conversation and assistant-response lengths in tokens.

    ``conversations`` has a ``tokens`` column (one row per conversation), ``responses`` a ``tokens`` column
    (one row per assistant response)."""
    fig, axes = plt.subplots(1, 2, figsize=(PAGE, 2.4))
    for ax, values, what in (
        (axes[0], conversations["tokens"], "conversation"),
        (axes[1], responses["tokens"], "assistant response"),
    ):
        values = np.asarray(values)
        top = max(values.max(), 10)
        bins = np.logspace(0, np.log10(top), 40)
        # exact ends: 10**log10(top) may round below top on some CPUs and drop the longest
        bins[[0, -1]] = 1, top
        ax.hist(values, bins=bins, color=PARADIGM_COLORS["hidden"], alpha=0.85)
        ax.set_xscale("log")
        ax.axvline(np.median(values), color="k", ls="--", lw=1, label=f"median {np.median(values):.0f}")
        if max_context and what == "conversation":
            ax.axvline(max_context, color=PARADIGM_COLORS["kv"], lw=1, label=f"max context {max_context}")
        ax.set_xlabel(f"{what} length (tokens)")
        ax.set_ylabel(f"{what}s (count)")
        ax.set_title(f"{what}s (n = {len(values)})")
        ax.legend(frameon=False)
    return finish_figure(fig)
