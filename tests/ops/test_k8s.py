"""deploy/k8s/: the production shape as a kustomize base of plain manifests, checked offline.

No cluster runs here. Every manifest is validated against Kubernetes' own OpenAPI schema
for a pinned version (kubernetes-validate bundles the schemas: nothing is fetched), in
strict mode, and the base is held to compose/compose.yaml: the same images, commands,
RTRL_* variables and secrets per process, with the intended differences listed by name in
tests/support/k8s.py. Breaking the parity on purpose must fail (the mutation table below).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from support import k8s

KUBERNETES = "1.33.0"
"""The Kubernetes version the manifests are validated against."""
ENTRYPOINT = "/usr/local/bin/rtrl-entrypoint"
GPU = "nvidia.com/gpu"
# Module -> (the file serving its /healthz, the variable holding that listener's port).
HEALTHZ = {
    "rtrl.ingest": ("ingest/http_api.py", "RTRL_INGEST_HTTP_PORT"),
    "rtrl.inference": ("inference/server.py", "RTRL_INFERENCE_HTTP_PORT"),
    "rtrl.analytics": ("analytics/query.py", "RTRL_ANALYTICS_QUERY_PORT"),
}


def workload(docs: list[dict], name: str) -> dict:
    (found,) = [d for d in k8s.workloads(docs) if d["metadata"]["name"] == name]
    return found


def pods(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(workload name, pod template metadata, pod spec) of every workload."""
    return [
        (d["metadata"]["name"], d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"])
        for d in k8s.workloads(docs)
    ]


def built(compose: dict) -> set[str]:
    """Containers running the rtrl image (compose's services built from this repo, the relay)."""
    return {n for n, s in compose["services"].items() if "build" in s} | {k8s.RELAY}


def stack_value(docs: list[dict], variable: str) -> str:
    return k8s.config_maps(docs)[k8s.STACK_CONFIG][variable]


def test_every_manifest_is_valid_kubernetes_in_strict_mode():
    docs = k8s.load_manifests()
    assert len(docs) > 20
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    # The validator does see mistakes: a misspelt field is refused.
    broken = copy.deepcopy(workload(docs, "ingest"))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbes"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_kustomization_lists_every_manifest_here_and_nothing_else():
    """kubectl apply -k renders the listed files as they are: no generators or patches in
    the base, one namespace set by the kustomization and by no manifest."""
    kustomization = yaml.safe_load((k8s.K8S / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "namespace", "resources"}
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    on_disk = {p.name for p in k8s.K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(resources) == on_disk, "a manifest is missing from kustomization.yaml, or extra"
    docs = k8s.load_manifests()
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == kustomization["namespace"]
    assert not [d["metadata"]["name"] for d in docs if "namespace" in d["metadata"]]
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects of one kind and name"


def test_every_rtrl_process_in_compose_runs_in_k8s_as_compose_runs_it():
    """Image, command, RTRL_* names and values, and secrets: the same, per container."""
    assert k8s.parity_errors(k8s.load_compose(), k8s.load_manifests()) == []


def _set_env(docs: list, container: str, name: str, **value: Any) -> None:
    env = k8s.containers(docs)[container]["env"]
    env[:] = [v for v in env if v["name"] != name] + [{"name": name, **value}]


def _drop_env(docs: list, container: str, name: str) -> None:
    env = k8s.containers(docs)[container]["env"]
    env[:] = [v for v in env if v["name"] != name]


def _secret(variable: str) -> dict:
    return {"valueFrom": {"secretKeyRef": {"name": k8s.secret_name(variable), "key": variable}}}


def _url_before_its_secret(docs: list, compose: dict) -> None:
    env = k8s.containers(docs)["analytics"]["env"]
    names = [v["name"] for v in env]
    i, j = names.index("RTRL_CLICKHOUSE_SINK_PASSWORD"), names.index("RTRL_CLICKHOUSE_URL")
    env[i], env[j] = env[j], env[i]


def _drop_workload(docs: list, compose: dict) -> None:
    docs.remove(workload(docs, "analytics"))


def _replace_entrypoint(docs: list, compose: dict) -> None:
    trainer = k8s.containers(docs)["trainer"]
    trainer["command"], trainer["args"] = trainer["args"][:1], trainer["args"][1:]


MUTATIONS: dict[str, tuple[str, Callable[[list, dict], None]]] = {
    # case: (the container the error must name, the change)
    "another image tag": (
        "ingest",
        lambda d, c: k8s.containers(d)["ingest"].update(image="rtrl:v2"),
    ),
    "a variable dropped": (
        "trainer",
        lambda d, c: _drop_env(d, "trainer", "RTRL_TRAINER_BATCH_SIZE"),
    ),
    "a variable compose does not name": (
        "ingest",
        lambda d, c: _set_env(d, "ingest", "RTRL_INGEST_SHADOW_MODE", value="1"),
    ),
    "another service's secret": (
        "inference",
        lambda d, c: _set_env(
            d,
            "inference",
            "RTRL_TRAINER_MANIFEST_SIGNING_KEY",
            **_secret("RTRL_TRAINER_MANIFEST_SIGNING_KEY"),
        ),
    ),
    "a secret from another Secret": (
        "ingest",
        lambda d, c: _set_env(
            d,
            "ingest",
            "RTRL_INGEST_EVENT_KEY",
            valueFrom={"secretKeyRef": {"name": "rtrl-all", "key": "RTRL_INGEST_EVENT_KEY"}},
        ),
    ),
    "a secret given as a literal": (
        "weight-sync",
        lambda d, c: _set_env(d, "weight-sync", "RTRL_WEIGHT_SYNC_TOKEN", value="hunter2"),
    ),
    "a shared value changed": (
        "reward-stream",
        lambda d, c: k8s.config_maps(d)[k8s.STACK_CONFIG].update(RTRL_KAFKA_PARTITIONS="24"),
    ),
    "a workload gone": ("analytics", _drop_workload),
    "a URL before the secret it names": ("analytics", _url_before_its_secret),
    "the entrypoint replaced": ("trainer", _replace_entrypoint),
    "SGLang without its admin key": (
        "sglang-control",
        lambda d, c: k8s.containers(d)["sglang-control"]["command"].__setitem__(
            -1, k8s.containers(d)["sglang-control"]["command"][-1].replace("admin-api-key", "x")
        ),
    ),
    "compose gains a variable": (
        "reward-stream",
        lambda d, c: c["services"]["reward-stream"]["environment"].update(RTRL_REWARD_GRACE_S="5"),
    ),
    "compose gives the trainer a new secret": (
        "trainer",
        lambda d, c: c["services"]["trainer"]["environment"].update(
            RTRL_TRAINER_HUB_TOKEN="${RTRL_HUB_TOKEN:?set it}"
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_breaking_the_parity_on_purpose_is_caught(case):
    culprit, mutate = MUTATIONS[case]
    compose, docs = k8s.load_compose(), k8s.load_manifests()
    mutate(docs, compose)
    errors = k8s.parity_errors(compose, docs)
    assert any(error.startswith(f"{culprit}:") for error in errors), errors


def test_each_process_holds_only_its_own_secrets_and_no_other_credential():
    """Guarantee 7 on Kubernetes: a container's secrets are compose's for that process
    (parity above), each from the Secret of its own name; no Secret object (no credential)
    is in the base; no pod gets a service account token or other Services' addresses."""
    compose, docs = k8s.load_compose(), k8s.load_manifests()
    assert not [d for d in docs if d["kind"] == "Secret"]
    maps = k8s.config_maps(docs)
    used = set()
    for name, container in k8s.containers(docs).items():
        assert all("configMapRef" in source for source in container.get("envFrom", [])), name
        for variable, source in k8s.environment(container, maps).items():
            if source[0] == "secret":
                assert source[1:] == (k8s.secret_name(source[2]), source[2]), (name, variable)
                used.add(source[2])
            elif source[0] == "configmap":
                assert source[1] == k8s.PUBLIC_KEYS and source[2] in k8s.PUBLIC_CONFIG
    for name, _, spec in pods(docs):
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name
        assert not [v for v in spec.get("volumes", []) if "secret" in v or "projected" in v]
    # The secrets no rtrl process holds are the infrastructure's (outside this base).
    assert k8s.compose_secrets(compose) - used == {
        "RTRL_KAFKA_PASSWORD_ADMIN",
        "RTRL_REDIS_PASSWORD_OPERATOR",
        *[s for s in k8s.compose_secrets(compose) if s.startswith("RTRL_GRAFANA_")],
    }
    for config_map, data in maps.items():
        assert config_map == k8s.STACK_CONFIG
        assert set(data) == set(compose["x-rtrl-env"]) - k8s.PUBLIC_CONFIG


def test_every_address_in_a_variable_names_a_service_of_the_base():
    """compose's addresses hold: the rtrl services are Services here, and Kafka, Redis,
    ClickHouse and the collector are ExternalName Services the operator points elsewhere."""
    docs = k8s.load_manifests()
    services = {
        d["metadata"]["name"]: {p["port"] for p in d["spec"].get("ports", [])}
        for d in docs
        if d["kind"] == "Service"
    }
    addresses = set()
    maps = k8s.config_maps(docs)
    for container in k8s.containers(docs).values():
        for source in k8s.environment(container, maps).values():
            if source[0] == "value":
                addresses |= set(
                    re.findall(r"(?:^|[/@,=])([a-z][a-z0-9-]*):(\d+)(?=$|[/,])", source[1])
                )
    assert {host for host, _ in addresses} >= {"kafka-1", "redis", "clickhouse", "otel-collector"}
    for host, port in addresses:
        assert host in services and int(port) in services[host], f"{host}:{port}"


def _probe_target(container: dict, probe: dict) -> tuple[str, Any]:
    if "exec" in probe:
        return "exec", tuple(probe["exec"]["command"])
    kind = "httpGet" if "httpGet" in probe else "tcpSocket"
    port = probe[kind]["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return kind, (port, probe[kind].get("path"))


def test_probes_ask_what_each_service_actually_serves():
    """/metrics on RTRL_METRICS_PORT (every rtrl process), /healthz on the HTTP listeners
    that route it, the heartbeat check compose's health checks run (through the image's
    entrypoint, which names the instance as the service names itself), SGLang's /health."""
    compose, docs = k8s.load_compose(), k8s.load_manifests()
    maps = k8s.config_maps(docs)
    metrics = int(stack_value(docs, "RTRL_METRICS_PORT"))
    assert ENTRYPOINT in (k8s.REPO / "compose" / "Dockerfile").read_text()
    for name, container in k8s.containers(docs).items():
        env = k8s.environment(container, maps)
        served: set[tuple[str, tuple]] = set()
        if name in built(compose):
            served.add(("httpGet", (metrics, "/metrics")))
            module = container["args"][container["args"].index("-m") + 1]
            if module in HEALTHZ:
                source, port_variable = HEALTHZ[module]
                assert 'add_get("/healthz"' in (k8s.REPO / source).read_text(), source
                served.add(("httpGet", (int(env[port_variable][1]), "/healthz")))
            check = compose["services"].get(name, {}).get("healthcheck", {}).get("test")
            if check:
                # compose names the entrypoint by its name on PATH, k8s by its path
                assert check[1] == "rtrl-entrypoint", check
                served.add(("exec", (ENTRYPOINT, *check[2:])))
        else:
            url = urlparse(compose["services"][name]["healthcheck"]["test"][1].split()[-1])
            served.add(("httpGet", (url.port, url.path)))
        served |= {("tcpSocket", (p["containerPort"], None)) for p in container["ports"]}
        probes = {
            kind: container[kind]
            for kind in ("livenessProbe", "readinessProbe", "startupProbe")
            if kind in container
        }
        # The sidecars' readiness is their server's (no heartbeat of their own, as in compose).
        assert "livenessProbe" in probes and (
            "readinessProbe" in probes or name.endswith("-sidecar")
        ), name
        for kind, probe in probes.items():
            assert _probe_target(container, probe) in served, (name, kind, probe)


def test_the_trainer_and_the_sglang_servers_get_gpus_and_nothing_else_does():
    docs = k8s.load_manifests()
    gpus = {}
    for name, container in k8s.containers(docs).items():
        resources = container["resources"]
        assert "cpu" in resources["requests"] and "memory" in resources["requests"], name
        assert "memory" in resources["limits"], name
        if GPU in resources["requests"] or GPU in resources.get("limits", {}):
            assert resources["requests"][GPU] == resources["limits"][GPU] >= 1, name
            gpus[name] = resources["requests"][GPU]
    assert set(gpus) == {"trainer", "sglang", "sglang-control"}
    args = k8s.containers(docs)["trainer"]["args"]
    assert (
        args[0] == "torchrun" and int(args[args.index("--nproc_per_node") + 1]) == gpus["trainer"]
    )
    for name, _, spec in pods(docs):
        if any(GPU in c["resources"]["requests"] for c in spec["containers"]):
            assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm, f"{name}: no /dev/shm beyond the container default"


def test_prometheus_is_told_to_scrape_every_rtrl_process_on_its_metrics_port():
    compose, docs = k8s.load_compose(), k8s.load_manifests()
    port = int(stack_value(docs, "RTRL_METRICS_PORT"))
    assert stack_value(docs, "RTRL_METRICS_BIND_HOST") == "0.0.0.0"
    scraped = set()
    for name, metadata, spec in pods(docs):
        serving = [c["name"] for c in spec["containers"] if c["name"] in built(compose)]
        assert serving, f"{name} runs no rtrl process"
        # Containers of one pod share its network: only one of them may bind the port.
        assert len(serving) == 1, f"{name}: {serving} would all bind {port}"
        assert metadata["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }, name
        (container,) = [c for c in spec["containers"] if c["name"] in serving]
        assert {"name": "metrics", "containerPort": port} in container["ports"], name
        scraped.add(container["name"])
    assert scraped == built(compose)


def test_services_and_disruption_budgets_select_the_pods_they_mean():
    docs = k8s.load_manifests()
    templates = {
        d["metadata"]["name"]: (d, d["spec"]["template"]["metadata"]["labels"])
        for d in k8s.workloads(docs)
    }

    def selected(selector: dict) -> list[str]:
        return [n for n, (_, labels) in templates.items() if selector.items() <= labels.items()]

    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("type") != "ExternalName":
            (name,) = selected(doc["spec"]["selector"])
            pod_ports = {
                p["name"]
                for c in templates[name][0]["spec"]["template"]["spec"]["containers"]
                for p in c["ports"]
            }
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= pod_ports, name
        elif doc["kind"] == "PodDisruptionBudget":
            (name,) = selected(doc["spec"]["selector"]["matchLabels"])
            # minAvailable 1 on a single replica would block every node drain.
            assert templates[name][0]["spec"]["replicas"] > 1 or "maxUnavailable" in doc["spec"]
    for name, (workload_doc, _) in templates.items():
        assert workload_doc["spec"]["selector"]["matchLabels"] == templates[name][1]
        if workload_doc["kind"] == "StatefulSet":
            assert ("Service", workload_doc["spec"]["serviceName"]) in {
                (d["kind"], d["metadata"]["name"]) for d in docs
            }
    budgets = {
        selected(d["spec"]["selector"]["matchLabels"])[0]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }
    assert {n for n, (d, _) in templates.items() if d["spec"]["replicas"] > 1} <= budgets


def test_the_relay_reads_the_variables_it_is_given():
    """The one k8s-only process: its RTRL_WEIGHT_SYNC_RELAY_* variables are RelaySettings'
    fields, and they parse."""
    from rtrl.weight_sync.relay import RelaySettings

    prefix = "RTRL_WEIGHT_SYNC_RELAY_"
    assert {f"{prefix}{field.upper()}" for field in RelaySettings.model_fields} >= set(
        k8s.RELAY_VARIABLES
    )
    RelaySettings(**{k[len(prefix) :].lower(): v for k, v in k8s.RELAY_VARIABLES.items()})


def test_the_deployment_guide_names_every_secret_and_public_key():
    guide = (k8s.REPO / "docs" / "deployment.md").read_text()
    docs = k8s.load_manifests()
    maps = k8s.config_maps(docs)
    for container in k8s.containers(docs).values():
        for source in k8s.environment(container, maps).values():
            if source[0] in ("secret", "configmap"):
                assert source[2] in guide, f"docs/deployment.md does not create {source[2]}"
    assert "](deployment.md)" in (k8s.REPO / "docs" / "operations.md").read_text()
