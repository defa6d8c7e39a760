"""A service's database URL names its sessions, unless the operator's URL names them already."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from shared.store.db import named_dsn


def _query(dsn: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(dsn).query)


def test_a_url_without_a_name_gets_the_services() -> None:
    dsn = named_dsn("postgresql://sked:pw@db:5432/sked", "sked-scheduler")
    assert dsn.startswith("postgresql://sked:pw@db:5432/sked?")
    assert _query(dsn) == {"application_name": ["sked-scheduler"]}


def test_the_other_parameters_are_kept() -> None:
    dsn = named_dsn("postgresql://db/sked?sslmode=require&connect_timeout=5", "sked-relay")
    assert _query(dsn) == {
        "sslmode": ["require"],
        "connect_timeout": ["5"],
        "application_name": ["sked-relay"],
    }


def test_a_name_the_operator_gave_is_left_alone() -> None:
    given = "postgresql://db/sked?application_name=prod-east"
    assert named_dsn(given, "sked-executor") == given


def test_what_is_not_a_postgres_url_is_left_alone() -> None:
    assert named_dsn("host=db dbname=sked", "sked-api") == "host=db dbname=sked"


def test_the_operators_query_is_kept_as_written() -> None:
    given = "postgresql://db/sked?options=-c%20statement_timeout%3D5000"
    assert named_dsn(given, "sked-relay") == f"{given}&application_name=sked-relay"
