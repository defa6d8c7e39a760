"""The compose stack: compose.yaml, Dockerfile and .dockerignore, checked without Docker.

compose.yaml is validated against the official Compose Specification JSON schema (vendored in
tests/data, see its README), each sked service's command is parsed by the real `sked` CLI, and
the wiring a schema cannot see (health-gated start order, a scalable executor, the environment)
is checked by hand. Every check is also shown to catch a broken copy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import io
import json
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from services.cli import SERVICES, build_parser
from services.executor.__main__ import parser as executor_parser
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"

INFRA = ("postgres", "redis", "rabbitmq")


# -- loading ---------------------------------------------------------------------------------


@functools.cache
def _compose_text() -> str:
    return COMPOSE.read_text("utf-8")


def load_compose() -> dict[str, Any]:
    """compose.yaml as Compose reads it: anchors and `<<` merge keys resolved.

    A fresh copy without aliases (through JSON), so a test can break one service's part.
    """
    doc = yaml.safe_load(_compose_text())
    assert isinstance(doc, dict), "compose.yaml is not a mapping"
    copy: dict[str, Any] = json.loads(json.dumps(doc))
    return copy


@functools.cache
def compose_validator() -> Any:
    schema = json.loads(SCHEMA.read_text("utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(doc: dict[str, Any]) -> list[Any]:
    return list(compose_validator().iter_errors(doc))


def describe(errors: list[Any]) -> str:
    return "\n".join(
        f"{'.'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in errors
    )


def sked_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services built from ./Dockerfile: migrate and every long-running sked service."""
    return {name: svc for name, svc in doc["services"].items() if "build" in svc}


def long_running(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sked services that run `sked service NAME` (everything built here but migrate)."""
    return {
        name: svc
        for name, svc in sked_services(doc).items()
        if isinstance(svc.get("command"), list) and svc["command"][:1] == ["service"]
    }


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def interpolate_defaults(value: str) -> str:
    """`${VAR:-default}` and `${VAR-default}` as Compose resolves them when VAR is unset."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)


def depends_on(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):  # the short form means service_started
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def container_ports(svc: dict[str, Any]) -> set[int]:
    targets = set()
    for port in svc.get("ports", []):
        if isinstance(port, dict):
            targets.add(int(port["target"]))
        else:  # [host_ip:][published:]target[/protocol]
            targets.add(int(str(port).rsplit(":", 1)[-1].split("/")[0]))
    return targets


def named_volume_mounts(svc: dict[str, Any]) -> dict[str, str]:
    """{target path: volume name} for the service's named-volume mounts."""
    mounts = {}
    for volume in svc.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type", "volume") == "volume" and volume.get("source"):
                mounts[volume["target"]] = volume["source"]
            continue
        source, _, rest = str(volume).partition(":")
        if rest and not source.startswith((".", "/", "~")):
            mounts[rest.split(":")[0]] = source
    return mounts


# -- 1. the Compose specification --------------------------------------------------------------


def test_the_vendored_schema_is_the_official_compose_specification() -> None:
    raw = SCHEMA.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "tests/data/compose-spec.json changed"
    schema = json.loads(raw)
    assert schema["title"] == "Compose Specification"
    assert "services" in schema["properties"]


def test_compose_file_validates_against_the_compose_specification() -> None:
    errors = schema_errors(load_compose())
    assert not errors, describe(errors)


def test_compose_file_has_no_version_key() -> None:
    assert "version" not in load_compose(), "`version:` is obsolete in the Compose specification"


def _put(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize(
    ("path", "value", "error_at"),
    [
        pytest.param(
            ("services", "scheduler", "depends_on", "postgres", "condition"),
            "service_hapy",
            ("services", "scheduler", "depends_on"),
            id="unknown-depends-on-condition",
        ),
        pytest.param(
            ("services", "jaeger", "ports"),
            "not-a-list",
            ("services", "jaeger", "ports"),
            id="ports-not-a-list",
        ),
        pytest.param(("servics",), {}, (), id="unknown-top-level-key"),
        pytest.param(
            ("services", "relay", "containr_name"),
            "relay",
            ("services", "relay"),
            id="misspelt-service-key",
        ),
        pytest.param(
            ("services", "postgres", "healthcheck", "intervall"),
            "3s",
            ("services", "postgres", "healthcheck"),
            id="misspelt-healthcheck-key",
        ),
        pytest.param(
            ("services", "executor", "command"),
            4,
            ("services", "executor", "command"),
            id="command-not-string-or-list",
        ),
        pytest.param(
            ("services", "scheduler", "environment"),
            "SKED_LOG_JSON=true",
            ("services", "scheduler", "environment"),
            id="environment-not-list-or-mapping",
        ),
        pytest.param(
            ("volumes", "pgdata"),
            {"drivr": "local"},
            ("volumes", "pgdata"),
            id="misspelt-volume-key",
        ),
    ],
)
def test_schema_rejects_a_broken_copy(
    path: tuple[str, ...], value: Any, error_at: tuple[str, ...]
) -> None:
    doc = load_compose()
    _put(doc, path, value)
    errors = schema_errors(doc)
    assert errors, f"setting {'.'.join(path)} = {value!r} passed schema validation"
    # ...and rejected for the change made, not for something else.
    assert any(tuple(e.absolute_path) == error_at for e in errors), describe(errors)
    if not error_at:
        assert any(path[-1] in e.message for e in errors), describe(errors)


def test_schema_rejects_unquoted_restart_no() -> None:
    # YAML 1.1 reads a bare `no` as false; Compose wants the string "no".
    text = _compose_text()
    assert 'restart: "no"' in text
    doc = yaml.safe_load(text.replace('restart: "no"', "restart: no"))
    assert doc["services"]["migrate"]["restart"] is False
    errors = schema_errors(doc)
    assert any(tuple(e.absolute_path) == ("services", "migrate", "restart") for e in errors), (
        describe(errors)
    )


# -- 2. commands the sked CLI accepts ----------------------------------------------------------


def command_problems(command: Any) -> list[str]:
    """Why `sked *command` would not start, or [] if the real CLI (and the service) accept it."""
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        return [f"command must be a list of strings (exec form), got {command!r}"]
    shown = shlex.join(["sked", *command])
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(command)
    except SystemExit as exc:
        return [f"`{shown}`: the sked CLI exits {exc.code}: {stderr.getvalue().strip()}"]
    if args.command_name != "service":
        return []
    if args.name not in SERVICES:
        return [f"`{shown}`: no service {args.name!r} in services.cli.SERVICES"]
    own_parser = importlib.import_module(SERVICES[args.name]).parser()
    try:
        with contextlib.redirect_stderr(stderr):
            own_parser.parse_args(args.args)
    except SystemExit as exc:
        return [f"`{shown}`: {args.name} exits {exc.code}: {stderr.getvalue().strip()}"]
    return []


def test_every_sked_command_is_accepted_by_the_sked_cli() -> None:
    services = sked_services(load_compose())
    assert {"migrate", "scheduler", "relay", "executor"} <= services.keys()
    problems = [
        f"{name}: {p}"
        for name, svc in services.items()
        for p in command_problems(svc.get("command"))
    ]
    assert not problems, "\n".join(problems)


def test_long_running_services_run_their_own_cli_service() -> None:
    doc = load_compose()
    assert doc["services"]["migrate"]["command"] == ["migrate"]
    for name, svc in long_running(doc).items():
        args = build_parser().parse_args(svc["command"])
        assert args.name in SERVICES
        assert args.name == name, f"compose service {name} runs `sked service {args.name}`"


def test_executor_flags_parse_with_the_executor_parser() -> None:
    args = build_parser().parse_args(load_compose()["services"]["executor"]["command"])
    flags = executor_parser().parse_args(args.args)
    assert flags.slots == 4
    assert flags.node_id is None, "a fixed --node-id would give every replica the same node id"


@pytest.mark.parametrize(
    "command",
    [
        ["service", "schedular"],
        ["migrat"],
        [],
        ["service"],
        ["service", "executor", "--slots", "four"],
        ["service", "executor", "--bogus"],
        ["service", "relay", "--batch", "10"],
        "service scheduler",
        ["service", "scheduler", 1],
    ],
    ids=repr,
)
def test_a_broken_command_is_detected(command: Any) -> None:
    assert command_problems(command)


# -- 3. wiring the schema cannot see -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "probe"),
    [
        ("postgres", ["pg_isready", "-U", "postgres"]),
        ("redis", ["redis-cli", "ping"]),
        ("rabbitmq", ["rabbitmq-diagnostics", "-q", "ping"]),
    ],
)
def test_infrastructure_has_a_healthcheck(name: str, probe: list[str]) -> None:
    check = load_compose()["services"][name].get("healthcheck")
    assert check, f"{name} has no healthcheck: service_healthy would never be reached"
    assert not check.get("disable")
    test = check["test"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    assert test[0] in ("CMD", "CMD-SHELL")
    words = shlex.split(test[1]) if test[0] == "CMD-SHELL" else test[1:]
    assert words[0] == probe[0]
    assert all(word in words for word in probe[1:]), f"{name}: {words} does not run {probe}"


@pytest.mark.parametrize(
    ("name", "data_dir"),
    [("postgres", "/var/lib/postgresql/data"), ("rabbitmq", "/var/lib/rabbitmq")],
)
def test_stateful_infrastructure_keeps_its_data_in_a_named_volume(name: str, data_dir: str) -> None:
    doc = load_compose()
    mounts = named_volume_mounts(doc["services"][name])
    assert data_dir in mounts, f"{name} keeps {data_dir} in the container only"
    assert mounts[data_dir] in (doc.get("volumes") or {}), f"volume {mounts[data_dir]} undeclared"


def test_rabbitmq_has_a_fixed_hostname() -> None:
    # Its node name, and so the directory its data lives in, comes from the host name.
    assert load_compose()["services"]["rabbitmq"].get("hostname") == "rabbitmq"


def test_sked_services_are_one_image_built_here() -> None:
    services = sked_services(load_compose())
    contexts = {
        svc["build"] if isinstance(svc["build"], str) else svc["build"].get("context")
        for svc in services.values()
    }
    assert contexts == {"."}, "every sked service builds ./Dockerfile"
    images = {svc.get("image") for svc in services.values()}
    assert len(images) == 1, f"one image for every sked service, got {images}"
    assert None not in images


def dependency_problems(doc: dict[str, Any]) -> list[str]:
    """Start order: sked services wait for healthy infrastructure and a finished migrate."""
    problems = []
    services = long_running(doc)
    missing = {"scheduler", "relay", "executor"} - services.keys()
    if missing:
        problems.append(f"no {sorted(missing)} service")
    for name, svc in services.items():
        deps = depends_on(svc)
        problems += [
            f"{name} does not wait for {infra} to be healthy"
            for infra in INFRA
            if deps.get(infra) != "service_healthy"
        ]
        if deps.get("migrate") != "service_completed_successfully":
            problems.append(f"{name} does not wait for migrate to complete")
        if svc.get("restart") != "unless-stopped":
            problems.append(f"{name} is not restarted (restart: {svc.get('restart')!r})")
    migrate = doc["services"].get("migrate") or {}
    if migrate.get("command") != ["migrate"]:
        problems.append(f"migrate runs {migrate.get('command')!r}")
    if migrate.get("restart") != "no":
        problems.append("migrate is one-shot: restart must be 'no'")
    if depends_on(migrate).get("postgres") != "service_healthy":
        problems.append("migrate does not wait for postgres to be healthy")
    return problems


def executor_problems(doc: dict[str, Any]) -> list[str]:
    """What would stop `docker compose up --scale executor=3` from giving three nodes."""
    executor = doc["services"]["executor"]
    problems = [
        f"executor sets {key}: its replicas would clash"
        for key in ("container_name", "ports", "hostname")
        if key in executor
    ]
    if "SKED_NODE_ID" in environment(executor):
        problems.append("executor sets SKED_NODE_ID: every replica would be the same node")
    if "--node-id" in (executor.get("command") or []):
        problems.append("executor sets --node-id: every replica would be the same node")
    return problems


def environment_problems(doc: dict[str, Any]) -> list[str]:
    """Every sked service points at this stack's Postgres, Redis, RabbitMQ and Jaeger."""
    problems = []
    services = doc["services"]
    postgres_env = environment(services["postgres"])
    expected = {
        "SKED_DATABASE_URL": ("postgresql", "postgres", 5432),
        "SKED_REDIS_URL": ("redis", "redis", 6379),
        "SKED_RABBITMQ_URL": ("amqp", "rabbitmq", 5672),
        "OTEL_EXPORTER_OTLP_ENDPOINT": ("http", "jaeger", 4318),
    }
    for name, svc in sked_services(doc).items():
        env = environment(svc)
        problems += [
            f"{name}: {key} is no sked setting"
            for key in env
            if key.startswith("SKED_")
            and key.removeprefix("SKED_").lower() not in Settings.model_fields
        ]
        if not env.get("OTEL_SERVICE_NAME"):
            problems.append(f"{name} has no OTEL_SERVICE_NAME")
        for key, (scheme, host, port) in expected.items():
            if not env.get(key):
                problems.append(f"{name} has no {key}")
                continue
            url = urlsplit(interpolate_defaults(env[key]))
            if (url.scheme, url.hostname, url.port) != (scheme, host, port):
                problems.append(f"{name}: {key} is not {scheme}://{host}:{port}: {env[key]}")
            elif host not in services:
                problems.append(f"{name}: {key} points at {host}, which is no service here")
        db = urlsplit(interpolate_defaults(env.get("SKED_DATABASE_URL", "")))
        if db.path.lstrip("/") != postgres_env.get("POSTGRES_DB", "postgres"):
            problems.append(f"{name}: database {db.path!r} is not the one postgres creates")
        if postgres_env.get("POSTGRES_HOST_AUTH_METHOD") != "trust" and db.password != (
            interpolate_defaults(postgres_env.get("POSTGRES_PASSWORD", ""))
        ):
            problems.append(f"{name}: the database password is not postgres's")
    return problems


def test_sked_services_start_after_healthy_infrastructure_and_migrations() -> None:
    problems = dependency_problems(load_compose())
    assert not problems, "\n".join(problems)


def test_executor_can_be_scaled() -> None:
    problems = executor_problems(load_compose())
    assert not problems, "\n".join(problems)


def test_sked_services_point_at_this_stack() -> None:
    problems = environment_problems(load_compose())
    assert not problems, "\n".join(problems)


def _environment_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    env: dict[str, Any] = doc["services"][name]["environment"]
    return env


@pytest.mark.parametrize(
    ("check", "break_it", "problem"),
    [
        pytest.param(
            dependency_problems,
            lambda d: _put(d, ("services", "scheduler", "depends_on", "redis"), {}),
            "scheduler does not wait for redis to be healthy",
            id="dependency-without-condition",
        ),
        pytest.param(
            dependency_problems,
            lambda d: _put(d, ("services", "relay", "depends_on"), [*INFRA, "migrate"]),
            "relay does not wait for postgres to be healthy",
            id="dependencies-in-short-form",
        ),
        pytest.param(
            dependency_problems,
            lambda d: d["services"]["executor"]["depends_on"].pop("migrate"),
            "executor does not wait for migrate to complete",
            id="no-wait-for-migrate",
        ),
        pytest.param(
            dependency_problems,
            lambda d: _put(d, ("services", "migrate", "restart"), "on-failure"),
            "migrate is one-shot",
            id="migrate-restarts",
        ),
        pytest.param(
            executor_problems,
            lambda d: _put(d, ("services", "executor", "container_name"), "sked-executor"),
            "executor sets container_name",
            id="executor-container-name",
        ),
        pytest.param(
            executor_problems,
            lambda d: _put(d, ("services", "executor", "ports"), ["9100:9100"]),
            "executor sets ports",
            id="executor-host-port",
        ),
        pytest.param(
            executor_problems,
            lambda d: _put(d, ("services", "executor", "environment", "SKED_NODE_ID"), "n1"),
            "executor sets SKED_NODE_ID",
            id="executor-node-id-variable",
        ),
        pytest.param(
            executor_problems,
            lambda d: d["services"]["executor"]["command"].extend(["--node-id", "n1"]),
            "executor sets --node-id",
            id="executor-node-id-flag",
        ),
        pytest.param(
            environment_problems,
            lambda d: _put(
                d, ("services", "scheduler", "environment", "SKED_REDIS_URL"), "redis://localhost"
            ),
            "scheduler: SKED_REDIS_URL is not redis://redis:6379",
            id="redis-on-localhost",
        ),
        pytest.param(
            environment_problems,
            lambda d: _environment_of(d, "relay").pop("OTEL_EXPORTER_OTLP_ENDPOINT"),
            "relay has no OTEL_EXPORTER_OTLP_ENDPOINT",
            id="no-otlp-endpoint",
        ),
        pytest.param(
            environment_problems,
            lambda d: _environment_of(d, "executor").update(
                SKED_DATABSE_URL=_environment_of(d, "executor").pop("SKED_DATABASE_URL")
            ),
            "executor: SKED_DATABSE_URL is no sked setting",
            id="misspelt-variable",
        ),
        pytest.param(
            environment_problems,
            lambda d: _put(d, ("services", "postgres", "environment", "POSTGRES_PASSWORD"), "x"),
            "the database password is not postgres's",
            id="password-mismatch",
        ),
    ],
)
def test_a_broken_wiring_is_detected(
    check: Callable[[dict[str, Any]], list[str]],
    break_it: Callable[[dict[str, Any]], object],
    problem: str,
) -> None:
    doc = load_compose()
    assert not check(doc)
    break_it(doc)
    problems = check(doc)
    assert any(problem in p for p in problems), problems


def test_jaeger_is_v2_with_ui_and_otlp_http() -> None:
    jaeger = load_compose()["services"]["jaeger"]
    image, _, tag = jaeger["image"].partition(":")
    assert image == "jaegertracing/jaeger"
    assert re.fullmatch(r"2\.\d+\.\d+", tag), f"pin a concrete Jaeger 2.x tag, not {tag!r}"
    assert {16686, 4318} <= container_ports(jaeger)


def test_the_environment_is_what_sked_settings_expect(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, svc in sked_services(load_compose()).items():
        for key, value in environment(svc).items():
            if key.startswith("SKED_"):
                monkeypatch.setenv(key, interpolate_defaults(value))
        settings = Settings()  # what every sked process reads
        assert settings.log_json is True, name
        assert settings.database_url.startswith("postgresql://postgres:"), name
        assert settings.redis_url == "redis://redis:6379/0", name
        assert settings.rabbitmq_url == "amqp://guest:guest@rabbitmq:5672/", name


def test_each_service_reports_traces_under_its_own_name() -> None:
    names = {
        name: environment(svc).get("OTEL_SERVICE_NAME")
        for name, svc in sked_services(load_compose()).items()
    }
    assert names == {name: f"sked-{name}" for name in names}


# -- the image -------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text("utf-8"))
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        assert stages, "the Dockerfile must start with FROM"
        stages[-1].append((word.upper(), rest.strip()))
    return stages


def _last(stage: list[tuple[str, str]], instruction: str) -> str | None:
    found = [args for word, args in stage if word == instruction]
    return found[-1] if found else None


def test_dockerfile_builds_the_sked_image() -> None:
    stages = dockerfile_stages()
    for stage in stages:
        assert stage[0][1].split()[0] == "python:3.11-slim"
    final = stages[-1]
    entrypoint = _last(final, "ENTRYPOINT")
    assert entrypoint is not None
    assert json.loads(entrypoint) == ["sked"]
    assert _last(final, "WORKDIR") == "/app"
    user = _last(final, "USER")
    assert user is not None
    assert user.split(":")[0] not in ("root", "0"), "the image must not run as root"

    installs = [
        shlex.split(args)
        for stage in stages
        for word, args in stage
        if word == "RUN" and re.search(r"\bpip install\b", args)
    ]
    assert any("." in words and "--no-cache-dir" in words for words in installs), installs


def test_dockerfile_copies_what_the_package_build_reads() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    needed |= {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    # package data (shared.store's SQL) lives under its top-level package's folder
    needed |= {p.split(".")[0] for p in pyproject["tool"]["setuptools"].get("package-data", {})}
    copied = set()
    for stage in dockerfile_stages():
        for word, args in stage:
            if word == "COPY" and "--from=" not in args:
                *sources, _dest = shlex.split(args)
                copied |= {s.rstrip("/") for s in sources if not s.startswith("--")}
    assert needed <= copied, f"the image build misses {sorted(needed - copied)}"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (or a directory above it) out of the build context."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_context_small_but_complete() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text("utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for junk in (".venv", ".git", ".pytest_cache", "shared/__pycache__/x.pyc"):
        assert _ignored(junk, patterns), f"{junk} is sent to the Docker build"
    needed = ["pyproject.toml", "README.md"]
    for package in ("shared", "services"):
        needed += [
            str(p.relative_to(ROOT))
            for p in (ROOT / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    assert "shared/store/migrations/0001_tasks_and_events.sql" in needed
    assert "shared/store/sql/tasks.sql" in needed
    kept_out = [path for path in needed if _ignored(path, patterns)]
    assert not kept_out, f".dockerignore keeps the build from seeing {kept_out}"
    assert _ignored("README.md", [*patterns, "*.md"]), "the check itself must see an exclusion"
