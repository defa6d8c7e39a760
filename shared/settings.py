"""Configuration from `SKED_*` environment variables: the only place that reads the environment
(this module, and the model it loads, `shared.settings_model`).

One set of variables points a whole deployment (or one test) at its own Postgres database,
Redis database and RabbitMQ vhost; every process reads them through `Settings`.

`Settings` is loaded on first use (PEP 562): pydantic-settings and the model cost ~150 ms to
import and build, and `sked status` — one read of one task — needs a single variable, which
`quick` gives it as set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.lazy import exports

if TYPE_CHECKING:
    from pydantic import ValidationError

    from shared.settings_model import WEAK_SECRET as WEAK_SECRET
    from shared.settings_model import Settings as Settings
    from shared.settings_model import parse_labels as parse_labels

PREFIX = "SKED_"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/sked"
DATABASE_SCHEMES = ("postgresql", "postgres")

__all__ = [
    "DATABASE_SCHEMES",
    "DEFAULT_DATABASE_URL",
    "PREFIX",
    "WEAK_SECRET",
    "Settings",
    "parse_labels",
    "quick",
    "refusals",
    "url_problem",
]


def quick(name: str) -> str | None:
    """One variable (`name` without the prefix) as set, unparsed and without a default; the
    name matched without regard to case, as `Settings` matches it. Only for a read path that
    must start fast; everything else reads `Settings`."""
    wanted = PREFIX + name.upper()
    found = None
    for key, value in os.environ.items():  # the last match, as pydantic-settings keeps it
        if key.upper() == wanted:
            found = value
    return found


def url_problem(value: str, schemes: Sequence[str]) -> str | None:
    """Why a URL is one no client library can read (never quoting it), or None: a misspelt
    scheme was retried forever, and a password holding an unencoded # or / was read as a port,
    the error quoting it into the log. Here, not in the model: `sked status` checks its URL
    without loading pydantic."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises for a port that is not a number in range)
        value.encode()  # a byte that is not UTF-8 in the variable: no client takes it
    except ValueError:
        return "not a valid URL (percent-encode reserved characters such as # / ? @ in a password)"
    if parts.scheme.lower() not in schemes:
        return f"the scheme must be one of {', '.join(schemes)}"
    if parts.fragment:
        return "a URL holds no #fragment (percent-encode a # in a password)"
    return None


__getattr__ = exports(
    __name__, dict.fromkeys(("Settings", "WEAK_SECRET", "parse_labels"), "shared.settings_model")
)


def refusals(exc: ValidationError) -> str:
    """Each refused variable by its name and why, without its value: one line each."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = error.get("loc") or ()
        where = f"{PREFIX}{str(loc[0]).upper()}: " if loc else ""
        why = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{where}{why}")
    return "invalid settings: " + "; ".join(lines)
