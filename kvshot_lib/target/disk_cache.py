"""Measurements kept between runs on one machine: a JSON table per kind under the cache folder
(``cost_models.json``, ``linear_kernels.json``, ``precision_probes.json``), keyed by what was measured.

:func:`read_table` gives a table (empty when absent or unreadable); :func:`save_entry` adds one entry, written
atomically; a read-only cache only costs a re-measurement, so a failed write is not an error.
"""

from __future__ import annotations

import json
import os

from .assets import cache_dir


def read_table(name: str) -> dict:
    """The table ``<cache>/<name>``, or ``{}``."""
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}


def save_entry(name: str, key: str, value) -> None:
    """Add ``key: value`` to the table ``<cache>/<name>`` (atomically; silently skipped where it cannot write)."""
    path = cache_dir() / name
    try:
        tmp = path.with_suffix(f".tmp-{os.getpid()}")  # one per process: test workers write at once
        tmp.write_text(json.dumps({**read_table(name), key: value}, indent=1))
        tmp.replace(path)
    except OSError:
        pass
