"""Every read command of `sked` takes --json (brief §8): parsed here, without running."""

from __future__ import annotations

import pytest

from services.cli import build_parser

TASK = "8da55d00-60d6-4b20-bac2-b0bf303bfd81"


@pytest.mark.parametrize(
    "argv",
    [
        ["status", TASK],
        ["list"],
        ["workflows"],
        ["events", TASK],
        ["logs", TASK],
        ["workflow", TASK],
        ["nodes"],
        ["dead"],
        ["degrade", "status"],
        ["token", "list"],
        ["token", "audit"],
    ],
)
def test_every_read_command_takes_json(argv: list[str]) -> None:
    assert build_parser().parse_args([*argv, "--json"]).json is True
