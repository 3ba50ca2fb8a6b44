"""The root of the project's errors and the one table of exit codes.

Every exception class the project defines derives from :class:`LigError` (a class that must also
be a library's or a builtin exception, so that existing handlers keep catching it, lists both).
Code raises; only the command-line layer (:func:`lig.cli.main`, or a picker worker's entry point)
turns an error that reaches it into one line, ``lig <command>: error: <message>``, and the exit
code its class declares, so every command ends the same way.

Exit codes (``lig --help`` and docs/ quote them):

====  ======================  =====================================================================
code  name                    meaning
====  ======================  =====================================================================
1     ``FAILURE``             the work could not be done: NATS failed, a port is in use, a record
                              is not in the file
2     ``USAGE``               a flag, an environment variable or an input file is unusable (also
                              argparse's code for a bad command line)
3     ``EXT_PROC_LOST``       the picker's ext_proc listener stopped without being asked to (so
                              that its supervisor restarts it)
130   ``INTERRUPTED``         Ctrl-C (SIGINT) ended the command
====  ======================  =====================================================================
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ExitCode(enum.IntEnum):
    """The exit codes of ``lig`` commands and services (the table above)."""

    FAILURE = 1
    USAGE = 2
    EXT_PROC_LOST = 3
    INTERRUPTED = 130


class LigError(Exception):
    """An error of this project; ``str(error)`` is the one line the user sees."""

    exit_code: ClassVar[ExitCode] = ExitCode.FAILURE


class ConfigError(LigError, ValueError):
    """A flag, an environment variable or a configuration file has an unusable value (the
    message names it)."""

    exit_code = ExitCode.USAGE


class InputError(LigError):
    """A file or page given to a tool cannot be used (the message names it and says why)."""

    exit_code = ExitCode.USAGE
