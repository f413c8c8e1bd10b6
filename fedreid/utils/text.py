"""Text from elsewhere made safe to print: one line, no terminal control, bounded length.

Names, site names and error messages that another party sends (a federated
search site, a remote node) reach terminals and log files. Printed verbatim,
an ANSI escape (``ESC [ ... m``, ``ESC ] ... BEL``) can recolour, clear or
retitle the operator's terminal, a newline can forge a log line ("missing:
nothing"), and a Unicode bidirectional override can show a name reversed.
:func:`printable` is the one place that turns such text into something safe
to show.
"""

from __future__ import annotations

import unicodedata
from typing import Any

__all__ = ["printable"]

#: Unicode categories shown escaped: controls (C0, DEL, C1, including ESC, CR, LF, TAB), format
#: characters (bidi overrides and isolates, zero-width joiners), surrogates, private use,
#: unassigned code points, and the line and paragraph separators.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: Any, max_chars: int = 300) -> str:
    """``str(value)`` as one line that shows as it reads, at most ``max_chars`` characters (plus ``...``).

    Contract: every character whose Unicode category is in
    :data:`_ESCAPED_CATEGORIES` becomes its Python escape (``ESC`` ->
    ``\\x1b``, a newline -> ``\\x0a``, U+202E -> ``\\u202e``), and a
    backslash becomes ``\\\\``, so an escape shown always stands for the
    character, never for text that spelled it. Other characters (letters of
    any script, spaces, punctuation) are kept. The result is cut at
    ``max_chars`` characters and marked with a trailing ``...`` when cut. The
    result holds no control character, whatever ``value`` held.
    """
    text = value if isinstance(value, str) else str(value)
    out: list[str] = []
    size = 0
    for ch in text:
        piece = "\\\\" if ch == "\\" else (_escape(ch) if unicodedata.category(ch) in _ESCAPED_CATEGORIES else ch)
        if size + len(piece) > max_chars:
            out.append("...")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)
