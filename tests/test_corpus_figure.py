"""The length histograms of notebook 00 count every conversation and response, the longest included.

Their log-spaced bins end at ``10**log10(longest)``, which rounds below the longest length for some lengths (13,
14, 17, ... with numpy here) and for others only on some CPUs, whose vector ``pow`` rounds differently: the
longest fell outside the last bin, and the committed figure differed from its redraw on another machine."""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvshot_lib.plots import corpus  # noqa: E402


@pytest.mark.parametrize("longest", [13, 14, 1109, 5855])
def test_every_length_is_counted(longest):
    lengths = pd.DataFrame({"tokens": [1, 2, 5, 9, longest, longest]})
    fig = corpus.plot_length_distributions(lengths, lengths)
    for ax in fig.axes:
        heights = [p.get_height() for p in ax.patches]
        assert sum(heights) == len(lengths), heights
        assert heights[-1] == 2  # both copies of the longest in the last bin
    plt.close(fig)
