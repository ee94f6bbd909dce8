"""What every gdn2 command line shares: one way to declare and parse options, one flag spelling, and one
line for an expected failure.

Options are declared once, as a dataclass whose fields carry their help (:func:`option`): every command's
flags (``gdn2 generate``, ``gdn2 prepare``, ...) and the trainer's recipe sections (``--train.lr`` ...)
are parsed from text by :func:`parse_text_value` against the field's type, and described by
:func:`describe_option`. :func:`parse_options` reads a command's flags into its dataclass.

Flags are spelled with underscores (``--max_new_tokens``); the dashed spelling (``--max-new-tokens``) is
accepted too. A value is ``--flag value`` or ``--flag=value``; a true/false flag given alone means true;
a list-typed flag may be repeated (``--input a --input b``). Values are literal text (a path with ``#``
in it is that path); only a value starting with ``[`` or ``{`` is read as a YAML flow list or mapping. An expected failure (a bad argument, config
key or value, a missing or corrupt file, a full disk) is printed as one line, ``<prog>: error:
<message>``, with exit status 2. ``--debug`` (or ``GDN2_DEBUG=1``) shows the traceback instead. A command
stopped by Ctrl-C, or by SIGTERM inside :func:`sigterm_stops`, ends with one line too (what was kept), and
the exit status a shell gives a process that signal ended (130, 143).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import signal
import sys
import threading
import types
import typing
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

EXIT_USAGE = 2

# Raised by our own checks (ValueError, TypeError for a value of the wrong type, FileNotFoundError...),
# by the YAML parser, and by the operating system for files the user named or a full disk.
EXPECTED = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)

T = TypeVar("T")
_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False,
               "off": False}


# --------------------------------------------------------------------------------------------------
# declaring options
# --------------------------------------------------------------------------------------------------

def option(default: Any = dataclasses.MISSING, help: str = "", *, positional: bool = False,
           choices: Optional[Sequence[Any]] = None, meaning_of_null: Optional[str] = None) -> Any:
    """A dataclass field that is an option: ``default`` (none: the option is required), the ``help``
    shown by ``--help``, ``positional`` (given without a flag; a list-typed one takes the rest),
    ``choices`` (the values allowed), ``meaning_of_null`` (what a null default stands for, for --help).
    Declare the dataclass ``kw_only`` so required and optional fields may mix."""
    metadata = {"help": help, "positional": positional, "choices": tuple(choices) if choices else None,
                "null": meaning_of_null}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def strip_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for ``Optional[T]``, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_text_value(raw: str, tp: Any, key: str) -> Any:
    """Turn the text ``raw`` (a command-line value) into a value of field type ``tp``; errors name ``key``.

    Text stays literal: a string (and a path, ``data/set #2`` included) is the text as typed; a
    number or true/false is read as one. Only a value that starts with ``[`` or ``{``, for a list-,
    mapping- or any-typed field, is read as a YAML flow list or mapping (``[a, b]``, ``{path: x,
    weight: 2}``; quote an element that holds ``#`` or ``,``: ``['set #2', b]``). Any other value of a
    list-typed field is that field's one element, read as literal text of the element's type."""
    from gdn2.config import check_type

    inner, optional = strip_optional(tp)
    if optional and raw.strip().lower() in ("null", "none", "~"):
        return None
    try:
        if inner is bool:
            word = _BOOL_WORDS.get(raw.strip().lower())
            if word is None:
                raise ValueError
            return word
        if inner is int:
            try:
                return int(raw)
            except ValueError:
                as_float = float(raw)  # 100e9, 1.5e6
                if not as_float.is_integer():
                    raise
                return int(as_float)
        if inner is float:
            return float(raw)
        if inner is str:
            return raw
    except ValueError:
        kind = {bool: "true/false", int: "an integer", float: "a number"}[inner]
        raise ValueError(f"{key}: expected {kind}, got {raw!r}") from None
    origin = typing.get_origin(inner)
    structured = raw.lstrip().startswith(("[", "{"))
    if origin is list and not structured:
        (elem,) = typing.get_args(inner) or (Any,)
        return check_type([parse_text_value(raw, elem, f"{key}[0]")], tp, key)  # --data.train data/x: one element
    if not structured:
        return check_type(raw, tp, key)  # literal text; check_type says when the field wants something else
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"{key}: cannot parse {raw!r} as a YAML flow list or mapping: "
                         f"{' '.join(str(e).split())}") from None
    if origin is list and not isinstance(value, list):
        value = [value]  # --data.train '{path: x, weight: 2}': one element
    if origin is list:
        (elem,) = typing.get_args(inner) or (Any,)
        value = [parse_text_value(v, elem, f"{key}[{i}]") if isinstance(v, str) and elem in (int, float) else v
                 for i, v in enumerate(value)]
    return check_type(value, tp, key)


def type_name(tp: Any) -> str:
    inner, optional = strip_optional(tp)
    if typing.get_origin(inner) is list:
        (elem,) = typing.get_args(inner) or (Any,)
        name = f"list[{getattr(elem, '__name__', 'any')}]"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | null" if optional else name


def format_value(value: Any) -> str:
    """A value as a user would type it (YAML spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        import yaml

        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def describe_option(flag: str, tp: Any, default: Any, help: str, meaning_of_null: Optional[str] = None,
                    choices: Optional[Sequence[Any]] = None) -> list[str]:
    """The two ``--help`` lines of one option: ``--flag (type, default: value)`` and its help."""
    if default is dataclasses.MISSING:
        shown = "required"
    else:
        shown = "default: " + format_value(default)
        if default is None and meaning_of_null:
            shown += f", meaning {meaning_of_null}"
    allowed = f"; one of {', '.join(map(format_value, choices))}" if choices else ""
    return [f"  {flag} ({type_name(tp)}{allowed}, {shown})", f"      {help}"]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def command_help(cls: type, prog: str, description: str = "") -> str:
    """``--help`` of a command whose options are dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    words = [f.name.upper() + ("..." if typing.get_origin(strip_optional(hints[f.name])[0]) is list else "")
             for f in fields if f.metadata.get("positional")]
    words += [f"--{f.name} {f.name.upper()}" for f in fields
              if not f.metadata.get("positional") and _default(f) is dataclasses.MISSING]
    lines = [f"usage: {prog} {' '.join(words)} [options]".replace("  ", " ")]
    if description:
        lines += ["", description.strip()]
    lines += ["", "options (type, default):"]
    for f in fields:
        flag = f.name.upper() if f.metadata.get("positional") else f"--{f.name}"
        lines += describe_option(flag, hints[f.name], _default(f), f.metadata.get("help", ""),
                                 f.metadata.get("null"), f.metadata.get("choices"))
    lines += ["  --help", "      this text", "  --debug", "      a traceback instead of one line for an expected error"]
    return "\n".join(lines)


def parse_options(cls: type[T], argv: Sequence[str], prog: str, description: str = "") -> Optional[T]:
    """Read ``argv`` into the options dataclass ``cls`` (see the module doc for the syntax); None after
    printing ``--help``. ValueError naming the flag for an unknown option, a value of the wrong type or
    outside its choices, a missing required option or a flag given twice."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    flags = sorted(f"--{n}" for n, f in fields.items() if not f.metadata.get("positional"))
    values: dict[str, Any] = {}
    free: list[str] = []
    argv = underscore_flags(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            print(command_help(cls, prog, description))
            return None
        if not arg.startswith("--") or arg == "--":
            free.append(arg)
            continue
        name, eq, raw = arg[2:].partition("=")
        f = fields.get(name)
        if f is None or f.metadata.get("positional"):
            raise ValueError(f"unknown option --{name}; options: {', '.join(flags)}")
        inner, _ = strip_optional(hints[name])
        if not eq:
            following = argv[i] if i < len(argv) else None
            if inner is bool and (following is None or following.lower() not in _BOOL_WORDS):
                raw = "true"  # a true/false flag given alone
            elif following is None:
                raise ValueError(f"--{name} needs a value")
            else:
                raw, i = following, i + 1
        if typing.get_origin(inner) is list:  # repeatable: each occurrence adds one value
            (elem,) = typing.get_args(inner) or (str,)
            values.setdefault(name, []).append(_checked(f, parse_text_value(raw, elem, f"--{name}"), f"--{name}"))
        elif name in values:
            raise ValueError(f"--{name} given twice")
        else:
            values[name] = _checked(f, parse_text_value(raw, hints[name], f"--{name}"), f"--{name}")
    for f in (f for f in fields.values() if f.metadata.get("positional")):
        key = f.name.upper()
        if typing.get_origin(strip_optional(hints[f.name])[0]) is list:
            (elem,) = typing.get_args(strip_optional(hints[f.name])[0]) or (str,)
            if free:
                values[f.name] = [_checked(f, parse_text_value(v, elem, key), key) for v in free]
            free = []
        elif free:
            values[f.name] = _checked(f, parse_text_value(free.pop(0), hints[f.name], key), key)
    if free:
        raise ValueError(f"unexpected argument {free[0]!r}; options look like --name value")
    for name, f in fields.items():
        if name not in values and _default(f) is dataclasses.MISSING:
            raise ValueError(f"{name.upper() if f.metadata.get('positional') else '--' + name} is required "
                             f"({prog} --help lists the options)")
    return cls(**values)


def list_items(text: str) -> list[str]:
    """The items of a list flag's text, separated by commas or spaces (``"3e-4,1e-3"``, ``"3e-4 1e-3"``)."""
    return text.replace(",", " ").split()


def parse_numbers(text: str, flag: str, kind: type = float, least: int = 1) -> list:
    """The distinct numbers of a list flag's text (see :func:`list_items`): floats finite and positive, or
    ints of at least ``least``; ValueError naming ``flag`` for anything else, a number given twice, or
    none at all."""
    import math

    values: list = []
    for word in list_items(text):
        try:
            value = kind(word)
        except ValueError:
            raise ValueError(f"{flag}: expected {'integers' if kind is int else 'numbers'}, got {word!r}") from None
        if kind is int and value < least:
            raise ValueError(f"{flag}: must be {'positive' if least == 1 else f'>= {least}'}, got {value}")
        if kind is float and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag}: must be positive, got {word!r}")
        if value in values:
            raise ValueError(f"{flag}: {word} is given twice")
        values.append(value)
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


def _checked(f: dataclasses.Field, value: Any, key: str) -> Any:
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{key}: must be one of {', '.join(map(format_value, choices))}; got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------
# running a command
# --------------------------------------------------------------------------------------------------

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


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal: Ctrl-C (SIGINT) or SIGTERM. Its message, when it has one, says what
    was kept; ``signum`` sets the exit status (128 + signum)."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum=signum)


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Stopped` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so a terminated command unwinds: its with-blocks and finally-clauses end its worker
    processes and remove its temporary files instead of dying with them in place. The previous handler
    comes back afterwards. Elsewhere than in the main thread it does nothing (handlers belong there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def told_elsewhere(error: BaseException, elsewhere: bool) -> BaseException:
    """Mark ``error`` as printed by another process of the same job (``elsewhere``: this is not rank 0 and
    every rank raises the same error), so that :func:`run` exits 2 without printing it: a job of many ranks
    says it once. Returns ``error``."""
    error.told_elsewhere = elsewhere  # type: ignore[attr-defined]
    return error


def run(main: Callable[[list[str]], Optional[int]], argv: Sequence[str], prog: str) -> int:
    """Call ``main(argv)`` (flags normalised); an expected failure becomes one line and exit 2 (no line in
    a process whose error :func:`told_elsewhere` marks)."""
    argv = underscore_flags(argv)
    debug = "--debug" in argv or os.environ.get("GDN2_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt as stop:
        print(f"{prog}: {' '.join(str(stop).split()) or 'interrupted'}", file=sys.stderr)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except BaseException as error:  # noqa: BLE001 - sorted below: expected ones become one line
        if debug or not _is_expected(error):
            raise
        if getattr(error, "told_elsewhere", False):
            return EXIT_USAGE
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, OSError) and error.filename and str(error.filename) not in message:
            message = f"{error.filename}: {message}"
        print(f"{prog}: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_USAGE
