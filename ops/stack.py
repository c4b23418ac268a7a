"""What the embedded stack runs: the plan the supervisor executes and `rtrl status` reads.

The plan is written to ``<state_dir>/stack.json`` by the supervisor; everything else
(CLI, tests, benchmarks) finds the running stack through that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from rtrl.config import Settings
from rtrl.ops import redis_acl, stack_secrets


class StackConfig(Settings):
    """Shape of the embedded stack (env prefix ``RTRL_STACK_``)."""

    model_config = SettingsConfigDict(env_prefix="RTRL_STACK_")

    inference_workers: int = Field(2, ge=1, le=16)
    """Inference worker processes; each serves both arms."""

    health_timeout_s: float = Field(240.0, gt=0)
    """How long `rtrl up` waits for every component to report healthy."""

    max_restarts: int = Field(5, ge=0)
    """Restarts of one crashed service before the supervisor gives up on it."""

    reward_fn_version: str = "r3"
    """Reward function the stack's reward_stream settles with (reward_stream/reward.py);
    the supervisor passes it on as RTRL_REWARD_REWARD_FN_VERSION, over any value in the
    environment. r1 pays for not editing: `rtrl demo --reward-fn r1` shows the
    reward-hacking monitor catching it."""

    @field_validator("reward_fn_version")
    @classmethod
    def _known_reward_fn(cls, version: str) -> str:
        from rtrl.reward_stream.reward import FUNCTIONS

        if version not in FUNCTIONS:
            raise ValueError(f"reward_fn_version {version!r} is not one of {sorted(FUNCTIONS)}")
        return version


EMBEDDED_TRAINER: dict[str, str] = {
    "RTRL_TRAINER_WHEN_BEHIND": "shed",
    "RTRL_TRAINER_OVERLAP_EVAL": "false",
    "RTRL_TRAINER_BATCH_SIZE": "32",
}
"""The embedded stack's trainer settings wherever the environment sets none (trainer/config.py
explains each). On a small shared machine the demo's traffic outruns a trainer that gates
every candidate, and its CPU share is fixed by the scheduler, not by its threads: judging
beside training only splits that share (each candidate then waits for the previous
verdict and is judged at half speed), and catching up trains on ever staler rollouts. So
the trainer judges inline, steps on 32 rollouts and sheds what it cannot take, keeping
event -> live a few seconds (`rtrl bench loop` measures it; docs/benchmarks.md)."""


DEMO_POLICY_TRAINER: dict[str, str] = {
    "RTRL_TRAINER_INITIAL_POLICY": "rtrl.simulator.warmstart:demo_policy",
    "RTRL_TRAINER_EVAL_SUITE": "rtrl.simulator.suite:demo_suite",
    "RTRL_TRAINER_CONTEXT_KEY": "rtrl.simulator.tasks:context_key",
}
"""The trainer's plug-ins when the stack runs no model of the user's (no RTRL_MODEL_DIR): the
demo's warm start, the simulated product's held-out tasks and its project tags. The trainer
names none of them itself: they belong to the shell (the layer test reads plug-in strings)."""


def embedded_trainer_env(environ: Mapping[str, str]) -> dict[str, str]:
    """EMBEDDED_TRAINER (and DEMO_POLICY_TRAINER without a model directory) with whatever
    ``environ`` sets instead."""
    defaults = {
        **EMBEDDED_TRAINER,
        **({} if environ.get("RTRL_MODEL_DIR") else DEMO_POLICY_TRAINER),
    }
    return {name: environ.get(name, value) for name, value in defaults.items()}


@dataclass
class ServiceSpec:
    name: str
    """Service package, started as ``python -m rtrl.<name>``."""
    instance: str
    ports: dict[str, int] = field(default_factory=dict)
    """Environment variable -> port assigned to it."""
    pid: int = 0
    restarts: int = 0
    state: str = "starting"

    @property
    def key(self) -> str:
        return f"{self.name}:{self.instance}"

    def log_path(self, state_dir: Path) -> Path:
        return state_dir / "logs" / f"{self.name}-{self.instance}.log"


# Start order: weight_sync first (the trainer publishes v0 to it), consumers before
# producers; stopped in reverse, so each consumer stops after what feeds it: the
# analytics sink, reading every topic, stops last and drains what the others wrote.
SERVICE_ORDER = ("weight_sync", "analytics", "trainer", "reward_stream", "inference", "ingest")


@dataclass
class StackFile:
    supervisor_pid: int
    state_dir: str
    kafka_bootstrap: str
    redis_url: str
    """Where the stack's Redis listens, without credentials: every client of this file reads
    it, so it names no password. A client connects as a Redis user (redis_url_as)."""
    clickhouse_url: str
    weight_sync_addr: str
    infra: dict[str, int]
    """Infrastructure process name -> pid (tansu, redis)."""
    services: list[ServiceSpec]
    started_ts: float
    reward_fn_version: str = ""
    """The reward function reward_stream settles with (StackConfig.reward_fn_version)."""

    def port(self, name: str, env_var: str, instance: str = "0") -> int:
        for spec in self.services:
            if spec.name == name and spec.instance == instance:
                return spec.ports[env_var]
        raise KeyError(f"{name}:{instance} is not part of the stack")

    def urls(self, name: str, env_var: str) -> list[str]:
        return [f"http://127.0.0.1:{s.ports[env_var]}" for s in self.services if s.name == name]

    def env(self) -> dict[str, str]:
        """Connection settings every service (and client) of this stack uses; not Redis's,
        which is each service's own user (stack_secrets.service_env)."""
        return {
            "RTRL_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "RTRL_CLICKHOUSE_URL": self.clickhouse_url,
            "RTRL_WEIGHT_SYNC_ADDR": self.weight_sync_addr,
            "RTRL_STATE_DIR": self.state_dir,
        }

    def redis_url_as(self, user: str) -> str:
        """This stack's Redis as ``user`` (ops/redis_acl.py), with the password the state
        directory's secrets hold for it: the operator's CLI and demo connect as ``operator``."""
        secrets = stack_secrets.load(Path(self.state_dir))
        if secrets is None:
            raise RuntimeError(
                f"no {stack_secrets.SECRETS_FILE} in {self.state_dir}: the stack's Redis takes no "
                "client without its user's password"
            )
        return redis_acl.url(self.redis_url, user, secrets.redis_passwords()[user])

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> StackFile:
        doc = json.loads(path.read_text())
        doc["services"] = [ServiceSpec(**s) for s in doc["services"]]
        return cls(**doc)


def stack_path(state_dir: Path) -> Path:
    return state_dir / "stack.json"
