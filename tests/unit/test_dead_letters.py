"""A refused message as an operator reads it (`sked dead`, GET /v1/dead): whatever the message
holds — headers of any type, a body that is not text, characters a terminal acts on — it is
read without raising, bounded, and printed inert; and so is what `sked status` shows of a
task that others wrote."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from services.cli.output import status_lines
from shared.dead_letters import DEAD_PREVIEW, REASON_HEADER, dead_letter_of
from shared.redact import for_terminal, printable
from tests.fakes.store import new_task
from tests.helpers import spec


def test_what_sked_wrote_is_read_back() -> None:
    headers = {REASON_HEADER: "not JSON: Expecting value", "x-sked-routing-key": "submit"}
    letter = dead_letter_of(b"{nope", headers, "submit", "m-1")
    assert letter.as_json() == {
        "reason": "not JSON: Expecting value",
        "routing_key": "submit",
        "message_id": "m-1",
        "size": 5,
        "body": "{nope",
    }


def test_rabbitmqs_own_dead_lettering_names_its_reason() -> None:
    deaths = [{"reason": "rejected", "queue": "sked.submit", "count": 1}]
    letter = dead_letter_of(b"x", {"x-death": deaths}, "submit.batch", None)
    assert (letter.reason, letter.routing_key) == (
        "dead-lettered by RabbitMQ: rejected",
        "submit.batch",
    )


@pytest.mark.parametrize(
    "headers",
    [
        None,
        "not a table",
        {REASON_HEADER: 7, "x-sked-routing-key": b"bytes"},
        {"x-death": "no"},
        {"x-death": [1, 2]},
        {"x-death": [{"reason": 3}]},
        {"x-death": []},
    ],
)
def test_headers_of_any_type_count_as_absent(headers: Any) -> None:
    letter = dead_letter_of(b"x", headers, None, 12)  # type: ignore[arg-type]
    assert (letter.reason, letter.routing_key, letter.message_id) == ("no reason given", "", None)


def test_a_large_or_binary_body_is_cut_and_replaced() -> None:
    body = b"\xff\xfe" + b"a" * 1_000_000
    letter = dead_letter_of(body, {REASON_HEADER: "r" * 10_000}, "k" * 1000, "i" * 1000)
    assert letter.size == len(body)
    assert len(letter.body) == DEAD_PREVIEW
    assert letter.body.startswith("\ufffd\ufffda")
    assert (len(letter.reason), len(letter.routing_key), len(letter.message_id or "")) == (
        2000,
        255,
        255,
    )


def test_printed_inert() -> None:
    hostile = "ok\x1b[2J\x1b]0;owned\x07\r\nnext\u202eevil\x00"
    shown = printable(hostile)
    assert shown.isprintable()
    assert shown == "ok\\x1b[2J\\x1b]0;owned\\x07\\r\\nnext\\u202eevil\\x00"
    assert printable("naïve 漢字") == "naïve 漢字"  # text stays as it is


def test_a_log_for_the_terminal_keeps_its_lines_and_tabs_only() -> None:
    hostile = "a\tb\nprogress 10%\rprogress 99%\x1b[1A\nnext\u202eevil\n"
    shown = for_terminal(hostile)
    assert shown == "a\tb\nprogress 10%\\rprogress 99%\\x1b[1A\nnext\\u202eevil\n"
    assert all(line.replace("\t", " ").isprintable() for line in shown.split("\n"))


def test_a_task_s_status_shows_what_others_wrote_inert() -> None:
    """`sked status` prints a task's name (a producer's), its error (its own output) and who
    paused it and why (an operator's): none of it can clear the screen or forge a line."""
    task = new_task(spec("nightly\x1b[2J"))
    task = dataclasses.replace(
        task,
        error="boom\r\nstatus:    success\x1b]0;owned\x07",
        paused_by="token:ops for bob\u202e",
        paused_at=datetime.now(UTC),
        paused_reason="why\nnot",
    )
    lines = status_lines(task)
    assert all(line.isprintable() for line in lines), lines
    assert "error:     boom\\r\\nstatus:    success\\x1b]0;owned\\x07" in lines
    assert sum(line.startswith("status:") for line in lines) == 1
