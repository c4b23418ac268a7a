"""deploy/k8s/ read the way tests/ops/test_k8s.py checks it against compose/compose.yaml.

The parity rule: every rtrl container compose runs (and each SGLang server) is a container
of the same name in one k8s workload, with compose's image, command, RTRL_* variable names
and values, and compose's secrets, each from the Secret of that name. The differences that
are meant are listed here, by name, and nothing else may differ.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose" / "compose.yaml"
K8S = REPO / "deploy" / "k8s"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
STACK_CONFIG = "rtrl-stack"
"""The ConfigMap of the base that holds compose's x-rtrl-env."""
PUBLIC_KEYS = "rtrl-public-keys"
"""The ConfigMap the operator creates with the public keys compose requires (``:?``)."""
PUBLIC_CONFIG = frozenset(
    {"RTRL_MANIFEST_PUBLIC_KEYS", "RTRL_API_KEY_PUBLIC_KEYS", "RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS"}
)
"""Variables compose requires that are not secret: public keys."""

# Intended differences, each for a reason docs/deployment.md gives.
VALUE_DIFFERENCES = {
    # The sidecar shares its SGLang server's pod, and follows the relays.
    ("sglang-sidecar", "RTRL_SGLANG_SIDECAR_URL"): "http://127.0.0.1:30000",
    ("sglang-control-sidecar", "RTRL_SGLANG_SIDECAR_URL"): "http://127.0.0.1:30000",
    ("sglang-sidecar", "RTRL_WEIGHT_SYNC_ADDR"): "weight-sync-relay:50071",
    ("sglang-control-sidecar", "RTRL_WEIGHT_SYNC_ADDR"): "weight-sync-relay:50071",
}
ARGS_DIFFERENCES = {
    # One process per GPU of the node (compose runs one process; its comment says torchrun).
    "trainer": ["torchrun", "--standalone", "--nproc_per_node", "8", "-m", "rtrl.trainer"],
}
RELAY = "weight-sync-relay"
"""The one workload compose has no counterpart for."""
RELAY_VARIABLES = {
    "RTRL_WEIGHT_SYNC_RELAY_UPSTREAM_ADDR": "weight-sync:50061",
    "RTRL_WEIGHT_SYNC_RELAY_BIND_HOST": "0.0.0.0",
    "RTRL_WEIGHT_SYNC_RELAY_PORT": "50071",
}

_REFERENCE = re.compile(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def secret_name(variable: str) -> str:
    """The Secret holding compose's secret ``variable`` (under that key): one Secret each."""
    return variable.lower().replace("_", "-")


def load_compose() -> dict[str, Any]:
    """compose.yaml as written (anchors merged, ``${...}`` left in place)."""
    return yaml.safe_load(COMPOSE.read_text())


def load_manifests() -> list[dict[str, Any]]:
    """Every document of every manifest the kustomization lists, in its order."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return docs


@dataclass(frozen=True)
class Expected:
    """What one container must be, derived from its compose service."""

    image: str
    built: bool
    """Built from this repository: its image's entrypoint names the instance."""
    argv: list[str]
    literals: dict[str, str]
    """Variable -> value (``$(S)`` where compose interpolates secret S into it)."""
    secrets: dict[str, str]
    """Variable -> the compose secret it carries."""
    public: dict[str, str]
    """Variable -> the public key it carries (ConfigMap rtrl-public-keys)."""


def defaults(text: str) -> str:
    """``${X:-default}`` -> default; ``${S:?error}`` -> ``$(S)``, Kubernetes' reference."""
    return _REFERENCE.sub(
        lambda m: m.group(3) if m.group(2) == ":-" else f"$({m.group(1)})", str(text)
    )


def expected_of(name: str, service: dict[str, Any]) -> Expected:
    command = service["command"]
    argv = shlex.split(command.replace("$$", "$")) if isinstance(command, str) else command
    if argv[:2] == ["sh", "-c"] and "\n" in argv[2]:
        # A script (SGLang's, which keeps its keys off the command line): the same in both.
        argv = ["sh", "-c", argv[2].replace("$$", "$")]
    elif argv[:2] == ["sh", "-c"]:
        # Compose needs a shell to expand a variable from the container's environment;
        # Kubernetes expands $(VAR) in a command itself, and runs the program directly.
        argv = shlex.split(argv[2].replace("$$", "$"))
        argv = argv[1:] if argv[0] == "exec" else argv
    if argv[:2] != ["sh", "-c"]:
        argv = [re.sub(r"\$(\w+)", r"$(\1)", arg) for arg in argv]
    literals: dict[str, str] = {}
    secrets: dict[str, str] = {}
    public: dict[str, str] = {}
    for variable, raw in service.get("environment", {}).items():
        whole = _REFERENCE.fullmatch(str(raw))
        if whole and whole.group(2) == ":?":
            target = public if whole.group(1) in PUBLIC_CONFIG else secrets
            target[variable] = whole.group(1)
        else:
            literals[variable] = VALUE_DIFFERENCES.get((name, variable), defaults(raw))
    image, argv = defaults(service["image"]), ARGS_DIFFERENCES.get(name, argv)
    return Expected(image, "build" in service, argv, literals, secrets, public)


def compose_expectations(compose: dict[str, Any]) -> dict[str, Expected]:
    """Container name -> what it must be: compose's rtrl services, its SGLang servers, and
    the relay (compose's shared environment and image, with the relay's own variables)."""
    out = {}
    for name, service in compose["services"].items():
        if "build" in service or str(service.get("image", "")).startswith("${RTRL_SGLANG_IMAGE"):
            out[name] = expected_of(name, service)
    relay = {
        "build": compose["x-rtrl-service"]["build"],
        "image": compose["x-rtrl-service"]["image"],
        "command": ["python", "-m", "rtrl.weight_sync.relay"],
        "environment": {
            **compose["x-rtrl-env"],
            "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN": "${RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN:?}",
            **RELAY_VARIABLES,
        },
    }
    out[RELAY] = expected_of(RELAY, relay)
    return out


def strings(node: Any) -> list[str]:
    """Every string in a YAML tree, keys included."""
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in strings(k) + strings(v)]
    if isinstance(node, list):
        return [s for item in node for s in strings(item)]
    return [node] if isinstance(node, str) else []


def compose_secrets(compose: dict[str, Any]) -> set[str]:
    """Every secret compose requires of the operator, for any service."""
    return {
        m.group(1)
        for text in strings(compose)
        for m in _REFERENCE.finditer(text)
        if m.group(2) == ":?" and m.group(1) not in PUBLIC_CONFIG
    }


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Container name -> container, over every workload (names are unique: checked)."""
    out: dict[str, dict[str, Any]] = {}
    for workload in workloads(docs):
        spec = workload["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["name"] not in out, f"two containers named {container['name']}"
            out[container["name"]] = container
    return out


def config_maps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def environment(container: dict[str, Any], maps: dict[str, dict[str, str]]) -> dict[str, tuple]:
    """Variable -> ("value", text) | ("secret", Secret, key) | ("configmap", ConfigMap, key),
    as the kubelet builds it: envFrom first, then env, which overrides it."""
    env: dict[str, tuple] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env |= {k: ("value", v) for k, v in maps[source["configMapRef"]["name"]].items()}
        else:
            env["<envFrom>"] = ("envFrom", str(source))
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = ("value", var["value"])
        elif "secretKeyRef" in ref:
            env[var["name"]] = ("secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
        elif "configMapKeyRef" in ref:
            key_ref = ref["configMapKeyRef"]
            env[var["name"]] = ("configmap", key_ref["name"], key_ref["key"])
        else:
            env[var["name"]] = ("other", str(ref))
    return env


def container_errors(name: str, expected: Expected, container: dict[str, Any], maps) -> list[str]:
    """How one container differs from what compose says it must be."""
    errors = []
    if container["image"] != expected.image:
        errors.append(f"{name}: image {container['image']}, compose has {expected.image}")
    argv = container.get("command", []) + container.get("args", [])
    if argv != expected.argv:
        errors.append(f"{name}: runs {argv}, compose runs {expected.argv}")
    if expected.built and "command" in container:
        errors.append(f"{name}: `command` replaces the image's entrypoint; use `args`")
    env = environment(container, maps)
    # A secret compose interpolates into a value is given under its own name, then $(S).
    inner = {s for v in expected.literals.values() for s in re.findall(r"\$\((\w+)\)", v)}
    wanted = set(expected.literals) | set(expected.secrets) | set(expected.public) | inner
    if set(env) != wanted:
        errors.append(
            f"{name}: variables differ from compose: k8s only {sorted(set(env) - wanted)},"
            f" compose only {sorted(wanted - set(env))}"
        )
    for variable, value in expected.literals.items():
        if variable in env and env[variable] != ("value", value):
            errors.append(f"{name}: {variable} is {env[variable]}, compose gives {value!r}")
    for variable, secret in {**expected.secrets, **{s: s for s in inner}}.items():
        if variable in env and env[variable] != ("secret", secret_name(secret), secret):
            errors.append(f"{name}: {variable} is {env[variable]}, compose gives secret {secret}")
    for variable, key in expected.public.items():
        if variable in env and env[variable] != ("configmap", PUBLIC_KEYS, key):
            errors.append(f"{name}: {variable} is {env[variable]}, not {PUBLIC_KEYS}'s {key}")
    order = [var["name"] for var in container.get("env", [])]
    for variable, value in expected.literals.items():
        for secret in re.findall(r"\$\((\w+)\)", value):
            if (
                variable in order
                and secret in order
                and order.index(secret) > order.index(variable)
            ):
                errors.append(f"{name}: {variable} refers to {secret}, defined after it")
    return errors


def parity_errors(compose: dict[str, Any], docs: list[dict[str, Any]]) -> list[str]:
    """Every way deploy/k8s differs from compose beyond the differences listed above."""
    expected = compose_expectations(compose)
    found = containers(docs)
    maps = config_maps(docs)
    errors = [f"{name}: no k8s container" for name in expected if name not in found]
    errors += [
        f"{name}: a container compose has no service for" for name in found if name not in expected
    ]
    for name in set(expected) & set(found):
        errors += container_errors(name, expected[name], found[name], maps)
    images = {e.image for e in expected.values()}
    secrets = compose_secrets(compose)
    for name, container in found.items():
        if container["image"] not in images:
            errors.append(f"{name}: image {container['image']} is none of compose's")
        for variable, source in environment(container, maps).items():
            if source[0] == "secret" and source[2] not in secrets:
                errors.append(f"{name}: {variable} holds {source[2]}, a secret compose lacks")
    return errors
