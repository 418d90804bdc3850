"""Where a command writes a folder of files (``kvshot export``'s ``--out``): refused where writing would destroy
something, written beside it and swapped in, so an interrupted write leaves the old folder or the new one.

* :func:`check_output_folder` refuses, before anything loads, an ``--out`` that is a file, that is the source
  folder (the drafter being exported) or holds it, and one that holds files unless ``force`` is given;
* :func:`replacing_folder` yields an empty folder beside ``out`` (``.<name>.partial-<pid>``, same file system);
  on success it swaps that folder in for ``out`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere
  two renames) and removes the old one; on an error it removes the partial folder and ``out`` is untouched.

``tests/test_export_safety.py`` kills an export while it writes its weights and finds the old folder intact.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from ..user_errors import UsageError

RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def check_output_folder(out: str | Path, source: str | Path | None = None, force: bool = False) -> Path:
    """``out`` as a path, or a :class:`UsageError` saying why writing there would destroy something."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass the path of a folder to write (it is created).")
    if source is not None:
        here, src = out.resolve(), Path(source).expanduser().resolve()
        if here == src or here in src.parents:
            what = "is the drafter's own folder" if here == src else f"holds the drafter's folder {src}"
            raise UsageError(
                f"--out {out} {what}: writing there would replace the checkpoint being exported. Pass another "
                "folder, e.g. --out exported/<name>."
            )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(
            f"--out {out} already holds files ({', '.join(sorted(p.name for p in out.iterdir())[:4])}); pass "
            "--force to replace that folder, or an empty or new folder."
        )
    return out


@contextlib.contextmanager
def replacing_folder(out: str | Path) -> Iterator[Path]:
    """An empty folder to write into; on exit without an error it takes ``out``'s place in one step."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.partial-*"):  # left by an earlier export that was killed
        shutil.rmtree(stale, ignore_errors=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()  # mode 0777 & ~umask, as a folder made any other way
    try:
        yield partial
        if not out.exists():
            partial.rename(out)
        elif not _exchange(partial, out):  # no atomic exchange here: the old folder steps aside first
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # the old folder after an exchange, or the partial one


def mode_like(reference: Path, files: list[Path]) -> None:
    """Give ``files`` the permissions of ``reference``: safetensors writes its files 0600, while a JSON file written
    beside them gets the user's usual mode (0644 under umask 022)."""
    mode = stat.S_IMODE(reference.stat().st_mode)
    for f in files:
        os.chmod(f, mode)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` atomically (Linux); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system or kernel has no exchange
        return False
    raise OSError(errno, os.strerror(errno), str(b))
