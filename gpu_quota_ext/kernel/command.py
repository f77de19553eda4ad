"""The `%gpucap` grammar: one line of text -> one Command, or CommandError with one line saying why.

Pure: no kernel, no server, no torch. IPython's magic_arguments does the tokenising and the options
(imported when first needed, so this module stays stdlib-only at import time); sizes go through
policy.parse_cap, the same parser the server uses, so the magic never accepts what the server rejects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..shared.sizes import CapSpec, PolicyError, parse_cap
from .help import DESCRIPTION, USAGE  # in help.py: the stand-in magic shows them without this module

# The words %gpucap takes in place of a cap; none takes --device (each acts on the whole kernel).
WORDS = ("reset", "panel", "park", "resume", "help")


class CommandError(ValueError):
    """A `%gpucap` line that cannot be used; the message is the one line the user sees (the magic raises it
    as IPython's UsageError)."""


@dataclass(frozen=True)
class Command:
    action: str  # "show", "set", "reset", "panel", "park", "resume", "help" or "cells"
    cap: Optional[CapSpec] = None  # for "set"
    ordinal: Optional[int] = None  # for "set": torch's cuda:N; None = every device of the kernel
    cells: Optional[bool] = None  # for "cells"


_parser_holder: list = []


def _gpucap_parser():
    """Built once, on first use: IPython's magic_arguments parser for the grammar above."""
    if not _parser_holder:
        from IPython.core.magic_arguments import argument, magic_arguments

        @magic_arguments()
        @argument(
            "value", nargs="?", help="a cap (0.3, 30%%, 12GiB, 12GB), 'reset', 'panel', 'park', 'resume' or 'help'"
        )
        @argument("-d", "--device", type=int, metavar="N", help="only this device: the kernel's cuda:N")
        @argument("--cells", choices=["on", "off"], help="report each cell's GPU memory after it runs")
        @argument("-h", "--help", action="store_true", help="show this help")
        def gpucap(line=""):
            pass

        gpucap.__doc__ = DESCRIPTION
        from IPython.core.magic_arguments import construct_parser

        gpucap.parser = construct_parser(gpucap)
        # argparse %-formats usage, and IPython's formatter puts the leading "%" back itself.
        gpucap.parser.usage = USAGE[1:].replace("%", "%%")
        _parser_holder.append(gpucap.parser)
    return _parser_holder[0]


def help_text() -> str:
    text = _gpucap_parser().format_help()
    return text[len("::"):].lstrip("\n") if text.startswith("::") else text  # IPython's reST marker


def parse_command(line: str, ordinals: Optional[Sequence[int]] = None) -> Command:
    """Parse one `%gpucap` line. `ordinals`: the kernel's devices (torch ordinals); None = not known
    (a kernel no server started), then any --device N >= 0 is accepted and checked when applied."""
    args = _parse_arguments(line)
    if args.help:
        return Command("help")
    value = args.value
    if args.cells is not None:
        if value is not None or args.device is not None:
            raise CommandError("--cells on|off stands alone: %gpucap --cells on")
        return Command("cells", cells=args.cells == "on")
    if value in WORDS:
        if args.device is not None:
            raise CommandError(f"--device cannot be used with '{value}'")
        return Command(value)
    if value is None:
        if args.device is not None:
            raise CommandError("--device N needs a cap: %gpucap --device 1 8GiB")
        return Command("show")
    try:
        cap = parse_cap(value)
    except PolicyError as error:
        raise CommandError(str(error)) from None
    ordinal = args.device
    if ordinal is not None:
        if ordinal < 0:
            raise CommandError(f"--device {ordinal}: a device is cuda:N with N from 0")
        if ordinals is not None and ordinal not in ordinals:
            known = ", ".join(f"cuda:{o}" for o in sorted(ordinals)) or "none"
            raise CommandError(f"--device {ordinal}: this kernel has no cuda:{ordinal} (its devices: {known})")
    return Command("set", cap=cap, ordinal=ordinal)


def _parse_arguments(line: str):
    parser = _gpucap_parser()
    try:
        from IPython.core.error import UsageError
    except ImportError:  # pragma: no cover - IPython is what runs magics
        UsageError = Exception
    try:
        return parser.parse_argstring(line or "")
    except UsageError as error:
        raise CommandError(_one_line(str(error))) from None
    except SystemExit:  # argparse paths that exit instead of calling error()
        raise CommandError(f"cannot read {line!r}; usage: {USAGE}") from None
    except ValueError as error:  # unbalanced quotes in the tokeniser
        raise CommandError(f"cannot read {line!r}: {_one_line(str(error))}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
