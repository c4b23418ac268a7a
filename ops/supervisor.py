"""The embedded stack's supervisor: one detached process that owns every other one.

It starts Tansu and a private redis-server on free ports (Redis answering only the
stack's users, each service as its own: ops/redis_acl.py), creates the topics, starts
each service as its own process group, restarts services that crash, and on SIGTERM
stops everything in reverse order. `rtrl up` starts it; `rtrl down` signals it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from rtrl import entrypoint, kafka, procs
from rtrl.config import StackSettings
from rtrl.ops import broker_record, redis_acl, stack_secrets
from rtrl.ops.stack import (
    SERVICE_ORDER,
    ServiceSpec,
    StackConfig,
    StackFile,
    embedded_trainer_env,
    stack_path,
)
from rtrl.rotation import rotate_if_over
from rtrl.runtime import owner_only_files

log = logging.getLogger("rtrl.ops.supervisor")

# How often the supervisor records what the memory-only broker holds that nothing
# durable has taken in yet (broker_record.py): the loss a crash would cause.
MEASURE_EVERY_S = 10.0
ROTATE_LOGS_EVERY_S = 5.0
"""How often the logs are checked against RTRL_LOG_MAX_BYTES (a stat per file)."""

# Port environment variables each service reads.
PORTS = {
    "weight_sync": ("RTRL_WEIGHT_SYNC_PORT", "RTRL_METRICS_PORT"),
    "trainer": ("RTRL_METRICS_PORT",),
    "reward_stream": ("RTRL_REWARD_WEB_PORT", "RTRL_METRICS_PORT"),
    "analytics": ("RTRL_ANALYTICS_QUERY_PORT", "RTRL_METRICS_PORT"),
    "inference": ("RTRL_INFERENCE_HTTP_PORT", "RTRL_METRICS_PORT"),
    "ingest": ("RTRL_INGEST_HTTP_PORT", "RTRL_INGEST_GRPC_PORT", "RTRL_METRICS_PORT"),
}


def plan(config: StackConfig) -> list[ServiceSpec]:
    instances = [
        (name, str(i))
        for name in SERVICE_ORDER
        for i in range(config.inference_workers if name == "inference" else 1)
    ]
    ports = iter(procs.free_ports(sum(len(PORTS[name]) for name, _ in instances)))
    return [
        ServiceSpec(name, instance, {var: next(ports) for var in PORTS[name]})
        for name, instance in instances
    ]


class Supervisor:
    def __init__(self, settings: StackSettings, config: StackConfig) -> None:
        self.settings = settings
        self.config = config
        self.state_dir = settings.state_dir.resolve()
        self.children: dict[str, procs.Proc] = {}
        self.infra: list[procs.Proc] = []
        self.stopping = False
        self.stack: StackFile | None = None
        self.broker: broker_record.BrokerHistory | None = None
        self.measured_at = 0.0
        self.rotated_at = 0.0

    @property
    def started_stack(self) -> StackFile:
        """The stack file start() made; every step after start() relies on it."""
        if self.stack is None:
            raise RuntimeError("the supervisor has not started the stack")
        return self.stack

    def start(self) -> StackFile:
        self.secrets = stack_secrets.ensure(self.state_dir)
        logs = self.state_dir / "logs"
        tansu = procs.start_tansu(logs / "tansu.log")
        redis = redis_acl.start(self.state_dir, self.secrets.redis_passwords(), logs / "redis.log")
        self.infra = [tansu, redis]
        specs = plan(self.config)
        ws_port = next(s.ports["RTRL_WEIGHT_SYNC_PORT"] for s in specs if s.name == "weight_sync")
        self.stack = StackFile(
            supervisor_pid=os.getpid(),
            state_dir=str(self.state_dir),
            kafka_bootstrap=f"127.0.0.1:{tansu.port}",
            redis_url=f"redis://127.0.0.1:{redis.port}/0",
            clickhouse_url=self.settings.clickhouse_url or f"chdb://{self.state_dir / 'chdb'}",
            weight_sync_addr=f"127.0.0.1:{ws_port}",
            infra={"tansu": tansu.pid, "redis": redis.pid},
            services=specs,
            started_ts=time.time(),
            reward_fn_version=self.config.reward_fn_version,
        )
        stack_settings = StackSettings(
            kafka_bootstrap=self.stack.kafka_bootstrap,
            kafka_partitions=self.settings.kafka_partitions,
        )
        kafka.wait_for_broker(stack_settings)
        kafka.ensure_topics(stack_settings)
        self.broker = broker_record.started(self.state_dir, stack_settings)
        if self.broker.previous is not None:
            log.info(
                "the previous broker %s is gone with its topics: %s",
                self.broker.previous.cluster_id,
                self.broker.previous,
            )
        self.measured_at = time.monotonic()
        for spec in specs:
            self._spawn(spec)
        self._save()
        return self.stack

    def _spawn(self, spec: ServiceSpec) -> None:
        env = {
            # The operator's environment stops here: the service gets what it reads and its own secrets only.
            **stack_secrets.service_env(
                spec.name, os.environ, self.secrets, self.started_stack.redis_url
            ),
            **self.started_stack.env(),
            "RTRL_KAFKA_PARTITIONS": str(self.settings.kafka_partitions),
            "RTRL_INSTANCE": spec.instance,
            "RTRL_REWARD_REWARD_FN_VERSION": self.config.reward_fn_version,
            **(embedded_trainer_env(os.environ) if spec.name == "trainer" else {}),
            "PYTHONUNBUFFERED": "1",
            **{var: str(port) for var, port in spec.ports.items()},
        }
        proc = procs.spawn(
            spec.key,
            [sys.executable, "-m", f"rtrl.{spec.name}"],
            spec.log_path(self.state_dir),
            env=env,
            inherit_env=False,
        )
        self.children[spec.key] = proc
        spec.pid = proc.pid
        spec.state = "running"
        log.info("started %s (pid %d)", spec.key, proc.pid)

    def _save(self) -> None:
        self.started_stack.write(stack_path(self.state_dir))

    def watch(self) -> None:
        while not self.stopping:
            changed = False
            for spec in self.started_stack.services:
                proc = self.children.get(spec.key)
                if proc is None or proc.alive() or spec.state == "failed":
                    continue
                code = proc.popen.returncode
                if spec.restarts >= self.config.max_restarts:
                    log.error("%s exited with %s; restart limit reached", spec.key, code)
                    spec.state = "failed"
                else:
                    log.warning("%s exited with %s; restarting", spec.key, code)
                    spec.restarts += 1
                    self._spawn(spec)
                changed = True
            for proc in self.infra:
                if not proc.alive():
                    log.error("%s exited; the stack cannot run without it, stopping", proc.name)
                    self.stopping = True
            if changed:
                self._save()
            if time.monotonic() - self.measured_at >= MEASURE_EVERY_S:
                self._measure_broker(final=False)
            if time.monotonic() - self.rotated_at >= ROTATE_LOGS_EVERY_S:
                self._rotate_logs()
            time.sleep(0.5)

    def _rotate_logs(self) -> None:
        """Every log under ``<state_dir>/logs/`` over RTRL_LOG_MAX_BYTES copied to its
        ``.1`` and truncated under its writers (rtrl/rotation.py)."""
        self.rotated_at = time.monotonic()
        for path in (self.state_dir / "logs").glob("*"):
            if path.suffix in (".log", ".out") and rotate_if_over(
                path, self.settings.log_max_bytes
            ):
                log.info("rotated %s past %d bytes", path.name, self.settings.log_max_bytes)

    def _measure_broker(self, *, final: bool) -> None:
        """Record what the broker holds that nothing durable has taken in yet; a reading
        that fails is logged and tried again next time, never a reason to stop."""
        from rtrl.reward_stream.config import RewardStreamSettings
        from rtrl.trainer.config import TrainerSettings

        self.measured_at = time.monotonic()
        if self.broker is None or self.broker.current is None:
            return
        settings = StackSettings(
            kafka_bootstrap=self.started_stack.kafka_bootstrap,
            kafka_partitions=self.settings.kafka_partitions,
        )
        try:
            current = broker_record.measure(
                settings,
                self.broker.current,
                joiner_group=RewardStreamSettings().app_id,
                trainer_group=TrainerSettings().consumer_group,
                final=final,
            )
        except Exception:
            log.exception("could not measure what the broker holds")
            return
        self.broker = broker_record.BrokerHistory(current, self.broker.previous)
        broker_record.write(self.state_dir, self.broker)

    def stop(self) -> None:
        for spec in reversed(self.stack.services if self.stack else []):
            proc = self.children.get(spec.key)
            if proc is not None:
                proc.stop(timeout_s=15)
                log.info("stopped %s", spec.key)
        if self.infra and self.infra[0].alive():
            self._measure_broker(final=True)
        for proc in reversed(self.infra):
            proc.stop(timeout_s=5)
        stack_path(self.state_dir).unlink(missing_ok=True)


def main() -> None:
    settings = StackSettings()
    config = StackConfig()
    # Logs, the broker record, Redis's append-only file and everything the services write
    # are the owner's alone; the services set the same for themselves.
    owner_only_files()
    (settings.state_dir / "logs").mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=settings.state_dir / "logs" / "supervisor.log",
        level=logging.INFO,
        format=entrypoint.LOG_FORMAT,
    )
    supervisor = Supervisor(settings, config)

    def request_stop(signum, frame) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        supervisor.start()
        supervisor.watch()
    finally:
        supervisor.stop()


if __name__ == "__main__":
    main()
