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


def test_a_timeout_is_said_not_left_blank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """asyncpg's connect timeout is a TimeoutError whose text is empty: `sked list` against a
    Postgres that never answered printed "sked: " and nothing else (found by an adversarial
    review). The command's error is now worded when its text is empty."""
    import services.cli.status as status

    def frozen(args: object) -> int:
        raise TimeoutError

    monkeypatch.setattr(status, "status", frozen)
    from services.cli import main

    assert main(["status", "00000000-0000-0000-0000-000000000001"]) == 2
    assert capsys.readouterr().err == "sked: timed out\n"
