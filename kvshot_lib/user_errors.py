"""The errors a user causes and can fix, and the exit codes the ``kvshot`` command ends with.

Any stage raises :class:`UsageError` for input it refuses on purpose (a bad value, a prompt that cannot be
decoded, a damaged weights file, an output folder that would destroy something) and :class:`MachineShort` where
this machine lacks the memory or disk a run needs. ``kvshot_lib/cli.py`` prints the message as one line,
``kvshot: <what was wrong; what to do instead>``, and exits with the error's code; a traceback is for bugs only.

The exit codes (``kvshot --help`` and ``docs/library.md`` list them too):

* ``0``: done;
* ``1``: a failure: the command was right, but something it needs failed or is missing (a notebook that failed,
  an asset not installed, a figure whose tables were never written);
* ``2``: a usage error: the arguments, or a file they name, are wrong (argparse's own convention);
* ``3``: this machine is short of the memory or disk the run needs (``kvshot run``; ``--force`` runs anyway).
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_MACHINE_SHORT = 3

EXIT_CODES_HELP = (
    "exit status: 0 done; 1 a failure (a notebook failed, an asset or a table is missing); 2 a usage error (the "
    "arguments, or a file they name, are wrong); 3 this machine is short of the memory or disk the run needs"
)


class UserError(Exception):
    """Something the user can fix: the message says what was wrong and what to do instead."""

    exit_code = EXIT_USAGE


class UsageError(UserError, ValueError):
    """Bad input: an argument, or a file an argument names, that the command refuses before it does harm."""


class MachineShort(UserError, RuntimeError):
    """This machine has less memory or disk than the run needs."""

    exit_code = EXIT_MACHINE_SHORT
