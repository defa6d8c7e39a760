"""`sked submit`'s flags as the spec they make: required labels (`--selector`) and preferred
ones (`--affinity`), each repeatable."""

from __future__ import annotations

from services.cli import build_parser
from services.cli.commands import spec_from_args


def test_selector_and_affinity_flags_make_the_specs_labels() -> None:
    argv = ["submit", "--command", "true", "--selector", "zone=eu", "--affinity", "disk=ssd"]
    spec = spec_from_args(build_parser().parse_args([*argv, "--affinity", "gpu=a100"]))
    assert spec.selector == {"zone": "eu"}
    assert spec.affinity == {"disk": "ssd", "gpu": "a100"}
    plain = spec_from_args(build_parser().parse_args(["submit", "--command", "true"]))
    assert (plain.selector, plain.affinity) == ({}, {})
