"""The Kubernetes manifests in deploy/kubernetes, checked without a cluster.

Every document of the Kustomize base (and the example Secret beside it) is validated against the
Kubernetes OpenAPI schemas by kubernetes-validate in strict mode (an unknown field fails) for
two Kubernetes versions. What a schema cannot see is checked by hand: names and labels,
selectors, resources and security contexts, the executor's RBAC, references to the ConfigMap
and the Secret, every SKED_* variable against shared/settings.py, every command against the
real `sked` CLI, and the heartbeat wiring. Each hand check is also shown to catch a broken copy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services.api.app import make_app as make_api
from services.cli import build_parser
from services.cli.commands import SERVICES
from services.heartbeat_monitor.http import make_app
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
DOCKERFILE = ROOT / "Dockerfile"

VERSIONS = ("1.30", "1.34")
IMAGE = "sked"  # the kustomization's `images:` entry, and compose.yaml's image name
EXECUTOR_SA = "sked-executor"

# Read by the executor's Kubernetes backend, which the Kubernetes-backend work adds to
# shared/settings.py (with `sked service executor --backend kubernetes`). Allowed here by name,
# so that this test does not depend on which of the two changes lands first.
K8S_BACKEND_SETTINGS = frozenset(
    {
        "SKED_BACKEND",
        "SKED_K8S_NAMESPACE",
        "SKED_K8S_NODE_SELECTOR",
        "SKED_K8S_TOLERATIONS",
        "SKED_K8S_IMAGE_PULL_SECRETS",
        "SKED_K8S_JOB_TTL_S",
    }
)

# What the executor may do, and nothing more: (namespace or None for cluster-wide, apiGroup,
# resource, verb).
EXECUTOR_GRANTS = frozenset(
    {(None, "", "nodes", v) for v in ("get", "list", "watch")}
    | {("sked-jobs", "batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")}
    | {("sked-jobs", "", "pods", v) for v in ("get", "list", "watch", "delete")}
    | {("sked-jobs", "", "pods/log", "get")}  # the log subresource serves only get
    # a workflow task's inputs: made beside its Job, remade on a conflict; never read back
    | {("sked-jobs", "", "secrets", v) for v in ("create", "delete")}
)
Grant = tuple[str | None, str, str, str]

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
LABEL_NAME = re.compile(r"^(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Doc = dict[str, Any]


# -- loading ---------------------------------------------------------------------------------


@functools.cache
def kustomization() -> Doc:
    doc = yaml.safe_load(KUSTOMIZATION.read_text("utf-8"))
    assert isinstance(doc, dict)
    return doc


def _load(path: Path) -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(path.read_text("utf-8")) if d is not None]
    assert all(isinstance(d, dict) for d in docs), f"{path.name}: a document is not a mapping"
    return docs


@functools.cache
def _base() -> tuple[tuple[str, Doc], ...]:
    return tuple((name, d) for name in kustomization()["resources"] for d in _load(DEPLOY / name))


@functools.cache
def _examples() -> tuple[tuple[str, Doc], ...]:
    return tuple((p.name, d) for p in sorted(DEPLOY.glob("*.example.yaml")) for d in _load(p))


def base() -> list[Doc]:
    """The documents `kubectl apply -k` creates (a fresh copy, so a test may break one)."""
    return copy.deepcopy([d for _, d in _base()])


def with_examples() -> list[Doc]:
    """The base plus the example Secret it expects the operator to create."""
    return base() + copy.deepcopy([d for _, d in _examples()])


def ident(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('namespace', '-')}/{doc['metadata']['name']}"


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def of_kind(docs: list[Doc], *kinds: str) -> list[Doc]:
    return [d for d in docs if d["kind"] in kinds]


def pod_specs(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, its pod spec) for every Deployment and Job."""
    for d in of_kind(docs, "Deployment", "Job"):
        yield d, d["spec"]["template"]["spec"]


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], workload: Doc) -> bool:
    return selector.items() <= pod_labels(workload).items()


def first_container(docs: list[Doc], kind: str, name: str) -> Doc:
    container: Doc = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return container


def lookup(docs: list[Doc], kind: str, name: str, namespace: str) -> Doc | None:
    """The object a pod in `namespace` would find by that name, if the documents hold it."""
    found = [
        d
        for d in of_kind(docs, kind)
        if d["metadata"]["name"] == name and d["metadata"].get("namespace") == namespace
    ]
    return found[0] if found else None


def containers(pod: Doc) -> list[Doc]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def config_data(doc: Doc) -> dict[str, str]:
    return {**doc.get("data", {}), **doc.get("stringData", {})}


def service_argv(container: Doc) -> list[str]:
    """The `sked` arguments a container runs: its command is the image's entrypoint, `sked`."""
    assert container.get("command") == ["sked"], f"{container['name']}: command is not [sked]"
    return list(container.get("args", []))


# -- 1. the Kustomize base -------------------------------------------------------------------


def test_kustomization_lists_every_manifest_in_the_directory() -> None:
    listed = kustomization()["resources"]
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    on_disk = {
        p.name
        for pattern in ("*.yaml", "*.yml")
        for p in DEPLOY.glob(pattern)
        if p != KUSTOMIZATION and not p.name.endswith(".example.yaml")
    }
    assert set(listed) == on_disk, (
        f"not listed: {sorted(on_disk - set(listed))}; missing: {sorted(set(listed) - on_disk)}"
    )


def test_the_example_secret_documents_the_secret_but_is_not_applied() -> None:
    examples = _examples()
    assert [d["kind"] for _, d in examples] == ["Secret"]
    assert not {name for name, _ in examples} & set(kustomization()["resources"])
    placeholders = config_data(examples[0][1]).values()
    assert all("REPLACE-ME" in value for value in placeholders), "a value is not a placeholder"


def test_kustomization_sets_no_namespace() -> None:
    # A `namespace:` would move the executor's Role and RoleBinding out of the jobs namespace.
    assert "namespace" not in kustomization()


def test_one_image_for_every_container_and_operators_can_override_it() -> None:
    assert [i["name"] for i in kustomization()["images"]] == [IMAGE]
    for workload, pod in pod_specs(base()):
        for c in containers(pod):
            name = re.sub(r"(:[^/:]+)?(@.+)?$", "", c["image"])
            assert name == IMAGE, f"{ident(workload)} runs {c['image']}: not the images: entry"


# -- 2. the Kubernetes schemas ---------------------------------------------------------------


def _documents() -> list[Any]:
    return [pytest.param(d, id=f"{f}:{ident(d)}") for f, d in (*_base(), *_examples())]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", _documents())
def test_document_validates_against_the_kubernetes_schema(doc: Doc, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        pytest.param(("spec", "replicsa"), 2, id="misspelt-field"),
        pytest.param(("spec", "replicas"), "two", id="wrong-type"),
        pytest.param(("spec", "template", "spec", "containers"), {}, id="containers-not-a-list"),
        pytest.param(("spec", "selector"), None, id="no-selector"),
    ],
)
def test_the_validator_rejects_a_broken_copy(path: tuple[str, ...], value: Any) -> None:
    doc = find(base(), "Deployment", "scheduler")
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


# -- 3. names, labels, selectors -------------------------------------------------------------


def label_problems(labels: dict[str, Any], where: str) -> list[str]:
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not DNS_SUBDOMAIN.match(prefix)) or not LABEL_NAME.match(name):
            problems.append(f"{where}: label key {key!r} is not valid")
        if not isinstance(value, str) or (value and not LABEL_NAME.match(value)):
            problems.append(f"{where}: label {key}={value!r} is not a valid value")
    return problems


def naming_problems(docs: list[Doc]) -> list[str]:
    """Object, container, volume and port names Kubernetes would refuse, and invalid labels.
    Names are held to DNS-1123 labels, which every kind here accepts."""
    problems = []
    for d in docs:
        meta, where = d["metadata"], ident(d)
        for name in (meta["name"], *([meta["namespace"]] if "namespace" in meta else [])):
            if not DNS_LABEL.match(name):
                problems.append(f"{where}: {name!r} is not a DNS-1123 label")
        if d["kind"] in CLUSTER_SCOPED and "namespace" in meta:
            problems.append(f"{where}: a cluster-scoped object has a namespace")
        problems += label_problems(meta.get("labels", {}), where)
    for workload, pod in pod_specs(docs):
        where = ident(workload)
        problems += label_problems(pod_labels(workload), where)
        names = [c["name"] for c in containers(pod)] + [v["name"] for v in pod.get("volumes", [])]
        bad = [n for n in names if not DNS_LABEL.match(n)]
        problems += [f"{where}: {n!r} is not a DNS-1123 label" for n in bad]
        for c in containers(pod):
            problems += [
                f"{where}: port name {p['name']!r} is not an IANA service name"
                for p in c.get("ports", [])
                if not PORT_NAME.match(p.get("name", ""))
            ]
    for svc in of_kind(docs, "Service"):
        problems += label_problems(svc["spec"]["selector"], ident(svc))
    return problems


def selector_problems(docs: list[Doc]) -> list[str]:
    problems = []
    deployments = of_kind(docs, "Deployment")
    for d in deployments:
        selector = d["spec"]["selector"]
        if set(selector) != {"matchLabels"}:
            problems.append(f"{ident(d)}: selector uses more than matchLabels")
        wanted = selector.get("matchLabels", {})
        if not selects(wanted, d):
            problems.append(f"{ident(d)}: selector does not match its pod template's labels")
        for other in deployments:
            if other is not d and selects(wanted, other):
                problems.append(f"{ident(d)}: selector also matches {ident(other)}'s pods")
    for svc in of_kind(docs, "Service"):
        namespace = svc["metadata"]["namespace"]
        chosen = [
            d
            for d in deployments
            if d["metadata"]["namespace"] == namespace and selects(svc["spec"]["selector"], d)
        ]
        if len(chosen) != 1:
            problems.append(f"{ident(svc)}: selects the pods of {len(chosen)} Deployments")
    return problems


def namespace_problems(docs: list[Doc]) -> list[str]:
    defined = {d["metadata"]["name"] for d in of_kind(docs, "Namespace")}
    return [
        f"{ident(d)}: namespace {d['metadata'].get('namespace')!r} is not defined here"
        for d in docs
        if d["kind"] not in CLUSTER_SCOPED and d["metadata"].get("namespace") not in defined
    ]


def test_names_and_labels_are_valid() -> None:
    assert naming_problems(with_examples()) == []


def test_selectors_match_their_pods_and_only_theirs() -> None:
    assert selector_problems(base()) == []


def test_every_object_is_in_a_namespace_of_the_base() -> None:
    docs = base()
    assert {d["metadata"]["name"] for d in of_kind(docs, "Namespace")} == {"sked", "sked-jobs"}
    assert namespace_problems(with_examples()) == []


# -- 4. resources and security ---------------------------------------------------------------


_UNITS = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(value: Any) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|Ki|Mi|Gi)?", str(value))
    assert match, f"quantity {value!r} not understood"
    return float(match[1]) * _UNITS[match[2] or ""]


def resource_problems(docs: list[Doc]) -> list[str]:
    problems = []
    for workload, pod in pod_specs(docs):
        for c in containers(pod):
            where = f"{ident(workload)} container {c['name']}"
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{where}: no {part} for {sorted(missing)}")
            for key, request in res.get("requests", {}).items():
                limit = res.get("limits", {}).get(key)
                if limit is not None and quantity(request) > quantity(limit):
                    problems.append(f"{where}: {key} request {request} over its limit {limit}")
    return problems


def image_uid() -> int:
    match = re.search(r"--uid (\d+)", DOCKERFILE.read_text("utf-8"))
    assert match, "the Dockerfile creates no user with a fixed uid"
    return int(match[1])


def security_problems(docs: list[Doc]) -> list[str]:
    problems = []
    for workload, pod in pod_specs(docs):
        where = ident(workload)
        ctx = pod.get("securityContext", {})
        if ctx.get("runAsNonRoot") is not True:
            problems.append(f"{where}: runAsNonRoot is not true")
        # The image's USER is a name: without a number the kubelet cannot check runAsNonRoot.
        if ctx.get("runAsUser") != image_uid():
            problems.append(f"{where}: runAsUser is not the image's uid {image_uid()}")
        if ctx.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: no RuntimeDefault seccomp profile")
        for c in containers(pod):
            cc = c.get("securityContext", {})
            if cc.get("runAsUser") == 0 or cc.get("runAsNonRoot") is False:
                problems.append(f"{where} container {c['name']}: runs as root")
            if cc.get("allowPrivilegeEscalation") is not False or cc.get("privileged"):
                problems.append(f"{where} container {c['name']}: may escalate privileges")
            if cc.get("capabilities") != {"drop": ["ALL"]}:
                problems.append(f"{where} container {c['name']}: capabilities are not drop ALL")
            if cc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where} container {c['name']}: root filesystem is writable")
    return problems


def test_every_container_has_requests_and_limits() -> None:
    assert resource_problems(base()) == []


def test_every_container_runs_unprivileged_as_the_image_user() -> None:
    assert security_problems(base()) == []


def volume_problems(docs: list[Doc]) -> list[str]:
    """Writable space is a bounded emptyDir: nothing from the host, no unbounded scratch."""
    problems = []
    for workload, pod in pod_specs(docs):
        for volume in pod.get("volumes", []):
            if set(volume) != {"name", "emptyDir"} or "sizeLimit" not in volume["emptyDir"]:
                problems.append(f"{ident(workload)}: volume {volume} is not a bounded emptyDir")
    return problems


def test_writable_paths_are_bounded_empty_dirs() -> None:
    assert volume_problems(base()) == []


# -- 5. service accounts and RBAC ------------------------------------------------------------


def api_token_problems(docs: list[Doc]) -> list[str]:
    """Only the executor gets an API token; every pod names a service account of the base."""
    problems = []
    accounts = {d["metadata"]["name"]: d for d in of_kind(docs, "ServiceAccount")}
    for workload, pod in pod_specs(docs):
        where, account = ident(workload), pod.get("serviceAccountName")
        if account not in accounts:
            problems.append(f"{where}: service account {account!r} is not in the base")
        wants = workload["metadata"]["name"] == "executor"
        if wants != (account == EXECUTOR_SA):
            problems.append(f"{where}: runs as {account!r}")
        if pod.get("automountServiceAccountToken") is not wants:
            problems.append(f"{where}: automountServiceAccountToken is not {wants}")
    return problems


def grants(docs: list[Doc]) -> dict[str, set[Grant]]:
    """{service account: its grants}, from every binding. A RoleBinding grants in its own
    namespace (also when it binds a ClusterRole); a ClusterRoleBinding cluster-wide."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    granted: dict[str, set[Grant]] = {}
    for binding in of_kind(docs, "RoleBinding", "ClusterRoleBinding"):
        ref, scope = binding["roleRef"], binding["metadata"].get("namespace")
        role = roles.get((ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"]))
        assert role is not None, f"{ident(binding)}: binds a missing {ref['kind']} {ref['name']}"
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", f"{ident(binding)}: binds a {subject}"
            who = f"{subject['namespace']}/{subject['name']}"
            granted.setdefault(who, set()).update(
                (scope, group, resource, verb)
                for rule in role["rules"]
                for group in rule.get("apiGroups", [])
                for resource in rule.get("resources", [])
                for verb in rule.get("verbs", [])
            )
    return granted


def rbac_problems(docs: list[Doc]) -> list[str]:
    problems = []
    for role in of_kind(docs, "Role", "ClusterRole"):
        for rule in role["rules"]:
            if "*" in (*rule.get("apiGroups", []), *rule.get("resources", []), *rule["verbs"]):
                problems.append(f"{ident(role)}: a wildcard in {rule}")
            if rule.get("nonResourceURLs") or rule.get("resourceNames"):
                problems.append(f"{ident(role)}: an unexpected rule {rule}")
        if "aggregationRule" in role:
            problems.append(f"{ident(role)}: aggregates other roles")
    executor = find(docs, "ServiceAccount", EXECUTOR_SA)["metadata"]["namespace"]
    granted = grants(docs)
    mine = granted.pop(f"{executor}/{EXECUTOR_SA}", set())
    problems += [f"the executor may also {g}" for g in sorted(mine - EXECUTOR_GRANTS, key=str)]
    problems += [f"the executor may not {g}" for g in sorted(EXECUTOR_GRANTS - mine, key=str)]
    problems += [f"{who} is granted {sorted(g, key=str)}" for who, g in granted.items()]
    return problems


def test_only_the_executor_gets_an_api_token() -> None:
    docs = base()
    assert api_token_problems(docs) == []
    assert find(docs, "ServiceAccount", "sked").get("automountServiceAccountToken") is False


def test_executor_rbac_grants_exactly_what_the_backend_needs() -> None:
    assert rbac_problems(base()) == []


def test_task_jobs_go_to_their_own_namespace_where_the_executor_has_its_role() -> None:
    docs = base()
    jobs = find(docs, "ConfigMap", "sked-config")["data"]["SKED_K8S_NAMESPACE"]
    assert find(docs, "Role", EXECUTOR_SA)["metadata"]["namespace"] == jobs
    # A pod can mount only Secrets of its own namespace: a task's Job never gets sked-secrets.
    assert jobs != find(with_examples(), "Secret", "sked-secrets")["metadata"]["namespace"]
    assert jobs not in {d["metadata"]["namespace"] for d in of_kind(docs, "Deployment")}


# -- 6. configuration: ConfigMap, Secret and shared/settings.py ------------------------------


def settings_env_names() -> set[str]:
    """The variables Settings reads: env_prefix + field name (case-insensitive), or an alias."""
    prefix = Settings.model_config.get("env_prefix", "")
    names = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias or field.alias
        names.add((alias if isinstance(alias, str) else f"{prefix}{name}").upper())
    return names


def env_sources(container: Doc) -> Iterator[tuple[str, str, str | None]]:
    """(kind, name, key) of each ConfigMap or Secret the container reads: key None for envFrom."""
    for source in container.get("envFrom", []):
        for field, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
            if field in source:
                yield kind, source[field]["name"], None
    for var in container.get("env", []):
        for field, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
            ref = var.get("valueFrom", {}).get(field)
            if ref is not None:
                yield kind, ref["name"], ref["key"]


def container_env(docs: list[Doc], container: Doc, namespace: str) -> set[str]:
    """The names of the variables a container gets, envFrom expanded."""
    names = {var["name"] for var in container.get("env", [])}
    for kind, name, key in env_sources(container):
        source = lookup(docs, kind, name, namespace)
        if key is None and source is not None:
            names.update(config_data(source))
    return names


def reference_problems(docs: list[Doc]) -> list[str]:
    """configMapKeyRef, secretKeyRef and envFrom that name a missing object or key."""
    problems = []
    for workload, pod in pod_specs(docs):
        namespace = workload["metadata"]["namespace"]
        for c in containers(pod):
            where = f"{ident(workload)} container {c['name']}"
            for kind, name, key in env_sources(c):
                source = lookup(docs, kind, name, namespace)
                if source is None:
                    problems.append(f"{where}: no {kind} {name} in namespace {namespace}")
                elif key is not None and key not in config_data(source):
                    problems.append(f"{where}: no key {key} in {kind} {name}")
    return problems


def variable_problems(docs: list[Doc]) -> list[str]:
    """Variables sked would ignore: a SKED_* name Settings does not read is a typo, and besides
    those only OpenTelemetry's own OTEL_* variables mean anything to a sked process."""
    known = settings_env_names() | K8S_BACKEND_SETTINGS
    given = [(ident(d), k) for d in of_kind(docs, "ConfigMap", "Secret") for k in config_data(d)]
    for workload, pod in pod_specs(docs):
        for c in containers(pod):
            namespace = workload["metadata"]["namespace"]
            given += [(ident(workload), name) for name in container_env(docs, c, namespace)]
    problems = []
    for where, name in given:
        if name.startswith("SKED_") and name not in known:
            problems.append(f"{where}: {name} is not a setting")
        elif not name.startswith(("SKED_", "OTEL_")):
            problems.append(f"{where}: {name} is read by nothing in sked")
    return problems


def test_every_config_reference_names_a_real_key() -> None:
    assert reference_problems(with_examples()) == []


def test_every_variable_is_a_setting() -> None:
    assert variable_problems(with_examples()) == []


def test_secrets_stay_out_of_the_configmap() -> None:
    docs = with_examples()
    config = config_data(find(docs, "ConfigMap", "sked-config"))
    secret = config_data(find(docs, "Secret", "sked-secrets"))
    urls = {"SKED_DATABASE_URL", "SKED_REDIS_URL", "SKED_RABBITMQ_URL"}
    assert set(secret) == {*urls, "SKED_HEARTBEAT_SECRET"}
    assert not set(config) & set(secret)


def test_only_the_services_that_sign_heartbeats_get_the_secret() -> None:
    docs = with_examples()
    holders = {
        workload["metadata"]["name"]
        for workload, pod in pod_specs(docs)
        for c in containers(pod)
        if "SKED_HEARTBEAT_SECRET" in container_env(docs, c, workload["metadata"]["namespace"])
    }
    assert holders == {"executor", "heartbeat-monitor"}


# -- 7. commands the sked CLI accepts --------------------------------------------------------


def parse(argv: list[str], parser: Any) -> Any:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` is refused: {stderr.getvalue().strip()}")


def deployment_commands() -> dict[str, list[str]]:
    return {
        d["metadata"]["name"]: service_argv(d["spec"]["template"]["spec"]["containers"][0])
        for d in of_kind(base(), "Deployment")
    }


def test_the_image_entrypoint_is_sked() -> None:
    assert 'ENTRYPOINT ["sked"]' in DOCKERFILE.read_text("utf-8")


def test_every_service_runs_once_and_names_a_real_service() -> None:
    commands = deployment_commands()
    assert sorted(commands) == sorted(SERVICES), "one Deployment per service, named after it"
    for name, argv in commands.items():
        args = parse(argv, build_parser())
        assert args.command_name == "service", f"{name} runs `sked {argv[0]}`"
        assert args.name == name, f"Deployment {name} runs `sked service {args.name}`"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_accepts_its_flags(name: str) -> None:
    args = parse(deployment_commands()[name], build_parser())
    own = importlib.import_module(SERVICES[name]).parser()
    parse(args.args, own)


def test_executor_runs_the_kubernetes_backend_under_its_pod_name() -> None:
    docs = with_examples()
    argv = deployment_commands()["executor"]
    assert argv[argv.index("--backend") + 1] == "kubernetes"
    # Each replica records the Jobs it launched under its node id: a fixed one would be shared.
    env = container_env(docs, first_container(docs, "Deployment", "executor"), "sked")
    assert "--node-id" not in argv
    assert "SKED_NODE_ID" not in env


def test_every_service_runs_at_least_two_replicas() -> None:
    # All are safe to scale (docs/architecture.md); with two, one restarting stalls nothing.
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in of_kind(base(), "Deployment")}
    assert min(replicas.values()) >= 2, replicas


def test_the_configuration_loads_as_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = with_examples()
    config = config_data(find(docs, "ConfigMap", "sked-config"))
    for key, value in {**config, **config_data(find(docs, "Secret", "sked-secrets"))}.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.heartbeat_url == config["SKED_HEARTBEAT_URL"]
    assert settings.log_json is True
    # The example's placeholder secret is refused: the executor and monitor would not start.
    with pytest.raises(ValueError, match="SKED_HEARTBEAT_SECRET"):
        settings.require_heartbeat_secret()


def test_migrate_job_runs_sked_migrate_once() -> None:
    job = find(base(), "Job", "migrate")
    pod = job["spec"]["template"]["spec"]
    assert parse(service_argv(pod["containers"][0]), build_parser()).command_name == "migrate"
    assert pod["restartPolicy"] in ("Never", "OnFailure"), "the schema does not catch Always"
    assert job["spec"].get("ttlSecondsAfterFinished"), "a finished Job would block upgrades"


# -- 8. the heartbeat-monitor: its Service, probes and SKED_HEARTBEAT_URL ---------------------


def monitor_routes() -> set[tuple[str, str]]:
    """(method, path) of the monitor's HTTP app (services/heartbeat_monitor/http.py)."""
    app = make_app(None, "x" * 32)  # type: ignore[arg-type]  # routes only; nothing is served
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}


def monitor_ports(docs: list[Doc]) -> dict[str, int]:
    """The monitor's HTTP ports (its `metrics` port is checked by metrics_problems)."""
    container = first_container(docs, "Deployment", "heartbeat-monitor")
    return {
        p["name"]: p["containerPort"] for p in container.get("ports", []) if p["name"] != METRICS
    }


def probe_problems(docs: list[Doc]) -> list[str]:
    """The monitor listens on the pod's interfaces at its container port and is probed on a
    real GET route; the other services serve no HTTP but their metrics, so they have no probes
    and no port but `metrics`."""
    problems = []
    container = first_container(docs, "Deployment", "heartbeat-monitor")
    flags = parse(service_argv(container), build_parser()).args
    ports = monitor_ports(docs)
    if flags[flags.index("--host") + 1] != "0.0.0.0":  # every interface of the pod
        problems.append("the monitor listens on loopback only: no Service reaches it")
    if list(ports.values()) != [int(flags[flags.index("--port") + 1])]:
        problems.append(f"container ports {ports} are not the --port the monitor listens on")
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container.get(kind, {}).get("httpGet", {})
        if ("GET", probe.get("path")) not in monitor_routes() or probe.get("port") not in ports:
            problems.append(f"{kind} {probe} is not a GET route on a container port")
    for workload, pod in pod_specs(docs):
        if workload["metadata"]["name"] in HTTP_SERVICES:
            continue
        http = ("readinessProbe", "livenessProbe", "startupProbe")
        ports = [p for c in containers(pod) for p in c.get("ports", []) if p["name"] != METRICS]
        if ports or any(key in c for c in containers(pod) for key in http):
            problems.append(f"{ident(workload)}: probes or ports, but it serves no HTTP")
    return problems


METRICS = "metrics"


def metrics_problems(docs: list[Doc]) -> list[str]:
    """Every sked container serves /metrics on the pod's interfaces at SKED_METRICS_PORT, names
    that port `metrics`, and its pod's annotations tell Prometheus where to scrape."""
    config = find(docs, "ConfigMap", "sked-config")["data"]
    if config.get("SKED_METRICS_HOST") != "0.0.0.0":
        return ["SKED_METRICS_HOST is not 0.0.0.0: Prometheus cannot reach the pods"]
    port = int(config.get("SKED_METRICS_PORT", "-1"))
    if port <= 0:
        return [f"SKED_METRICS_PORT {port}: no metrics served"]
    problems = []
    for workload, pod in pod_specs(docs):
        if workload["kind"] != "Deployment":
            continue
        where = ident(workload)
        for c in containers(pod):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if ports.get(METRICS) != port:
                problems.append(f"{where}: no container port {METRICS} = {port}")
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        wanted = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
        wanted["prometheus.io/path"] = "/metrics"
        if {k: annotations.get(k) for k in wanted} != wanted:
            problems.append(f"{where}: scrape annotations {annotations} are not {wanted}")
    return problems


def heartbeat_url_problems(docs: list[Doc]) -> list[str]:
    """SKED_HEARTBEAT_URL reaches the monitor's POST route through its Service, by a name that
    resolves from the jobs namespace too."""
    url = urlsplit(find(docs, "ConfigMap", "sked-config")["data"]["SKED_HEARTBEAT_URL"])
    host = (url.hostname or "").removesuffix(".cluster.local").split(".")
    if len(host) != 3 or host[2] != "svc":
        return [f"SKED_HEARTBEAT_URL host {url.hostname} is not <service>.<namespace>.svc"]
    service = lookup(docs, "Service", host[0], host[1])
    if service is None:
        return [f"SKED_HEARTBEAT_URL: no Service {host[0]} in namespace {host[1]}"]
    problems = []
    if not selects(service["spec"]["selector"], find(docs, "Deployment", "heartbeat-monitor")):
        problems.append(f"Service {host[0]} does not select the heartbeat-monitor")
    targets = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == url.port]
    ports = monitor_ports(docs)
    if not targets or ports.get(targets[0], targets[0]) not in ports.values():
        problems.append(f"port {url.port} of Service {host[0]} does not reach the monitor")
    if ("POST", url.path) not in monitor_routes():
        problems.append(f"SKED_HEARTBEAT_URL path {url.path} is not the monitor's POST route")
    return problems


def test_the_monitor_alone_serves_http_and_is_probed_on_it() -> None:
    assert probe_problems(base()) == []


def test_heartbeats_reach_the_monitor_through_its_service() -> None:
    assert heartbeat_url_problems(base()) == []


def test_every_service_is_scraped_at_its_metrics_port() -> None:
    assert metrics_problems(base()) == []


# -- 8b. the operator API: its Service and probes ---------------------------------------------

HTTP_SERVICES = ("heartbeat-monitor", "api")  # the services that serve HTTP besides /metrics


def api_problems(docs: list[Doc]) -> list[str]:
    """The API listens on the pod's interfaces at its `http` port, is probed there on a real
    GET route that needs no token, and a Service reaches that port."""
    app = make_api(Settings(), None, None)  # type: ignore[arg-type]  # routes only
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    container = first_container(docs, "Deployment", "api")
    flags = parse(service_argv(container), build_parser()).args
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    problems = []
    if flags[flags.index("--host") + 1] != "0.0.0.0":
        problems.append("the API listens on loopback only: no Service reaches it")
    if ports.get("http") != int(flags[flags.index("--port") + 1]):
        problems.append(f"container port http {ports.get('http')} is not the API's --port")
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container.get(kind, {}).get("httpGet", {})
        if ("GET", probe.get("path")) not in routes or probe.get("port") != "http":
            problems.append(f"{kind} {probe} is not a GET route on the http port")
        elif probe.get("path", "").startswith("/v1/") and probe.get("path") != "/v1/openapi.json":
            problems.append(f"{kind} probes {probe.get('path')}, which needs a token")
    services = [
        s
        for s in of_kind(docs, "Service")
        if selects(s["spec"]["selector"], find(docs, "Deployment", "api"))
    ]
    targets = {p["targetPort"] for s in services for p in s["spec"]["ports"]}
    if not targets & {"http", ports.get("http")}:
        problems.append("no Service reaches the API's http port")
    return problems


def test_the_api_is_probed_and_reached_through_its_service() -> None:
    assert api_problems(base()) == []


# -- 9. every hand check catches a broken copy -----------------------------------------------


def _break_label(docs: list[Doc]) -> None:
    find(docs, "Deployment", "relay")["metadata"]["labels"]["app.kubernetes.io/component"] = "-x"


def _break_name(docs: list[Doc]) -> None:
    find(docs, "Deployment", "relay")["metadata"]["name"] = "Relay"


def _break_selector(docs: list[Doc]) -> None:
    find(docs, "Deployment", "relay")["spec"]["selector"]["matchLabels"]["tier"] = "x"


def _break_limits(docs: list[Doc]) -> None:
    del first_container(docs, "Deployment", "recovery")["resources"]["limits"]["memory"]


def _break_root(docs: list[Doc]) -> None:
    first_container(docs, "Deployment", "scheduler")["securityContext"]["runAsUser"] = 0


def _break_volume(docs: list[Doc]) -> None:
    pod = find(docs, "Deployment", "executor")["spec"]["template"]["spec"]
    pod["volumes"][0] = {"name": "tmp", "hostPath": {"path": "/tmp"}}


def _break_token(docs: list[Doc]) -> None:
    pod = find(docs, "Deployment", "relay")["spec"]["template"]["spec"]
    del pod["automountServiceAccountToken"]


def _break_rbac_wildcard(docs: list[Doc]) -> None:
    find(docs, "Role", EXECUTOR_SA)["rules"][0]["verbs"] = ["*"]


def _break_rbac_extra(docs: list[Doc]) -> None:
    find(docs, "Role", EXECUTOR_SA)["rules"].append(
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    )


def _break_secret_key(docs: list[Doc]) -> None:
    env = first_container(docs, "Deployment", "relay")["env"]
    ref = next(e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e)
    ref["key"] = "SKED_DB_URL"


def _break_variable(docs: list[Doc]) -> None:
    find(docs, "ConfigMap", "sked-config")["data"]["SKED_LOG_LEVLE"] = "DEBUG"


def _break_heartbeat_url(docs: list[Doc]) -> None:
    data = find(docs, "ConfigMap", "sked-config")["data"]
    data["SKED_HEARTBEAT_URL"] = "http://heartbeat-monitor:8470/heartbeat"


def _break_probe(docs: list[Doc]) -> None:
    probe = first_container(docs, "Deployment", "heartbeat-monitor")["livenessProbe"]
    probe["httpGet"]["path"] = "/health"


def _break_metrics(docs: list[Doc]) -> None:
    meta = find(docs, "Deployment", "recovery")["spec"]["template"]["metadata"]
    meta["annotations"]["prometheus.io/port"] = "9090"


def _break_api_probe(docs: list[Doc]) -> None:
    probe = first_container(docs, "Deployment", "api")["readinessProbe"]
    probe["httpGet"]["path"] = "/v1/tasks"  # needs a token: never ready


def _break_namespace(docs: list[Doc]) -> None:
    find(docs, "Deployment", "relay")["metadata"]["namespace"] = "default"


@pytest.mark.parametrize(
    ("breaks", "check"),
    [
        (_break_label, naming_problems),
        (_break_name, naming_problems),
        (_break_selector, selector_problems),
        (_break_limits, resource_problems),
        (_break_root, security_problems),
        (_break_volume, volume_problems),
        (_break_token, api_token_problems),
        (_break_rbac_wildcard, rbac_problems),
        (_break_rbac_extra, rbac_problems),
        (_break_secret_key, reference_problems),
        (_break_variable, variable_problems),
        (_break_heartbeat_url, heartbeat_url_problems),
        (_break_probe, probe_problems),
        (_break_metrics, metrics_problems),
        (_break_namespace, namespace_problems),
        (_break_api_probe, api_problems),
    ],
    ids=lambda f: f.__name__.removeprefix("_break_").removesuffix("_problems"),
)
def test_a_broken_copy_is_detected(breaks: Any, check: Any) -> None:
    docs = with_examples()
    assert check(docs) == []
    breaks(docs)
    assert check(docs), f"{breaks.__name__} passed {check.__name__}"
