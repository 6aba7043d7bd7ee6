"""``CLISource``: upstream's raw view of a command line, ``{key: value}`` before any typing.

Scripts and tests written against upstream read a command line this way to pick out their own
keys; ``CLI.from_args`` does the typed parsing (``twinkle.cli.parser``), so nothing here checks a
value or knows a field."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


class CLISource:
    """``CLISource(argv=None).load()``: ``--key value`` and ``--key=value`` give the value as
    written (a string); a ``--key`` followed by another flag or by nothing is ``True``; ``--no-key``
    and ``--no_key`` are ``False``. A word that follows no flag is skipped. ``argv`` defaults to
    ``sys.argv[1:]``."""

    def __init__(self, argv: Sequence[str] | None = None):
        self.argv = list(sys.argv[1:] if argv is None else argv)

    def load(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        i = 0
        while i < len(self.argv):
            token = self.argv[i]
            i += 1
            if not token.startswith("--") or len(token) == 2:
                continue
            name, has_value, value = token[2:].partition("=")
            if has_value:
                found[name] = value
            elif name[:3] in ("no-", "no_") and len(name) > 3:
                found[name[3:]] = False
            elif i < len(self.argv) and not self.argv[i].startswith("--"):
                found[name] = self.argv[i]
                i += 1
            else:
                found[name] = True
        return found
