"""What every gdn2 command line shares: one flag spelling, and one line for an expected failure.

An expected failure (a bad argument, config key or value, a missing or corrupt file, a full disk) is
printed as one line, ``<prog>: error: <message>``, with exit status 2. ``--debug`` (or ``GDN2_DEBUG=1``)
shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable, Optional, Sequence

EXIT_USAGE = 2

# Raised by our own checks (ValueError, TypeError for a value of the wrong type, FileNotFoundError...),
# by the YAML parser, and by the operating system for files the user named or a full disk.
EXPECTED = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def underscore_flags(argv: Sequence[str]) -> list[str]:
    """``--max-new-tokens 5`` -> ``--max_new_tokens 5`` (and ``--a-b=c`` -> ``--a_b=c``): flags are
    spelled with underscores, the dashed spelling is accepted. Values are left alone."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


def _is_expected(error: BaseException) -> bool:
    if isinstance(error, EXPECTED):
        return True
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return True
    try:
        import yaml

        return isinstance(error, yaml.YAMLError)
    except ImportError:  # pragma: no cover - yaml is a dependency
        return False


def run(main: Callable[[list[str]], Optional[int]], argv: Sequence[str], prog: str) -> int:
    """Call ``main(argv)`` (flags normalised); an expected failure becomes one line and exit 2."""
    argv = underscore_flags(argv)
    debug = "--debug" in argv or os.environ.get("GDN2_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BaseException as error:  # noqa: BLE001 - sorted below: expected ones become one line
        if debug or not _is_expected(error):
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, OSError) and error.filename and str(error.filename) not in message:
            message = f"{error.filename}: {message}"
        print(f"{prog}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_USAGE
