"""Text on its way to a log line or a terminal, made safe (pure): what others wrote shown
inert, and the passwords of URLs masked.

Names, reasons and errors come from producers, operators and tasks: a line break or a
terminal's escape among them would forge a log line or a line of output, so each such
character is written as its escape. A URL's password (a database's, Alertmanager's) can reach
an error message from a library that quotes the URL it was given; every log line and every
error the CLI prints passes through `masked`.
"""

from __future__ import annotations

import re

# scheme://user:password@ — the password up to the last @ before a space or the end (one
# holding an unencoded @ is masked whole too)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@]*:)[^\s]*@")


def masked(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` in it written as ***."""
    if "://" not in text:
        return text
    return _URL_PASSWORD.sub(r"\1***@", text)


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (controls, escapes, line breaks)
    written as its Python escape: for what anyone could have put there."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def for_terminal(text: str) -> str:
    """`printable`, but keeping line breaks and tabs: many lines that anyone could have
    written (a task's log) as a terminal may show them. A carriage return is escaped too: it
    lets a line overwrite what an earlier one said."""
    return "\n".join(
        "\t".join(printable(part) for part in line.split("\t")) for line in text.split("\n")
    )
