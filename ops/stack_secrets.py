"""The embedded stack's own secrets, and which process holds which.

`rtrl up` generates them on the first start of a state directory (``secrets.json``,
owner-only, 32 random bytes each) and keeps them across restarts; there is no default
secret. Each service process is started with a fresh environment: the operating
system's basics, the stack's non-secret settings, its own settings prefix, only the
secrets in SERVICE_SECRETS for it, and RTRL_REDIS_URL as its own Redis user (a service
runs as the user of its name: ops/redis_acl.py), never the operator's whole environment.
The CLI reads the operator's query token and Redis password from the same file.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pydantic import SecretStr

from rtrl import signing
from rtrl.api_keys import KeyAuthority
from rtrl.config import StackSettings
from rtrl.ops import redis_acl

SECRETS_FILE = "secrets.json"
_REDIS_PASSWORD = "redis_password_"
"""The prefix of a Redis user's password field; the user's name follows it."""


@dataclass(frozen=True)
class StackSecrets:
    analytics_query_token: str
    """Opens the analytics sink's POST /query: the operator (rtrl report, status)."""
    weight_sync_publish_token: str
    """Publishes weight versions: the trainer (and weight_sync, which checks it)."""
    weight_sync_subscribe_token: str
    """Follows weight versions: inference workers (and weight_sync, which checks it)."""
    reward_trainer_mac_key: str
    """Authenticates rewards to the trainer (HMAC-SHA256 key): the joiner and the trainer
    (rtrl/signing.py says why a key of their own is enough)."""
    reward_analytics_mac_key: str
    """Authenticates rewards and late records to the analytics sink (HMAC-SHA256 key): the
    joiner and the sink."""
    manifest_signing_key: str
    """Signs weight manifests (Ed25519 private key): the trainer alone; workers hold its public key."""
    rollout_signing_key: str
    """Signs rollout records (Ed25519 private key): inference workers; the joiner holds its public key."""
    api_key_signing_key: str
    """Signs API key records (Ed25519 private key): the operator (rtrl keys, the demo) alone;
    the gateway and the serving API hold its public key. No service holds it."""
    event_mac_key: str
    """Authenticates telemetry events (HMAC-SHA256 key): the gateway, which writes them, and
    the joiner, which verifies them (rtrl/signing.py says why a shared key)."""
    analytics_event_mac_key: str
    """Authenticates telemetry events to the analytics sink (HMAC-SHA256 key): the gateway and
    the sink. A key of its own, so the sink, which answers queries, cannot forge an event
    the joiner would take."""
    rollout_mac_key: str
    """Authenticates rollout records to the joiner (HMAC-SHA256 key): inference workers and
    the joiner, which verifies this cheap tag instead of the Ed25519 signature (it re-emits
    every rollout it joins inside a reward it signs, so it could forge one anyway). The
    trainer-side readers (the sink) check the signature."""
    redis_password_operator: str
    """Redis user ``operator`` (ops/redis_acl.py has each user's keys): the CLI and the demo.
    Each Redis password below is held by the service of that name alone, inside its
    RTRL_REDIS_URL; Redis itself keeps only their SHA-256 (redis/users.acl)."""
    redis_password_ingest: str
    """Redis user ``ingest``: the gateway."""
    redis_password_inference: str
    """Redis user ``inference``: the serving API (every worker)."""
    redis_password_weight_sync: str
    """Redis user ``weight_sync``: the weight registry."""
    redis_password_trainer: str
    """Redis user ``trainer``."""
    redis_password_reward_stream: str
    """Redis user ``reward_stream``: the joiner."""
    redis_password_analytics: str
    """Redis user ``analytics``: the sink."""

    @classmethod
    def generate(cls) -> StackSecrets:
        tokens = {
            f.name: secrets.token_urlsafe(32) for f in fields(cls) if f.name.endswith("_token")
        }
        keys = {
            f.name: signing.generate_private_key()
            for f in fields(cls)
            if f.name.endswith("_signing_key")
        }
        macs = {
            f.name: signing.generate_mac_key() for f in fields(cls) if f.name.endswith("_mac_key")
        }
        passwords = {
            f.name: secrets.token_urlsafe(32)
            for f in fields(cls)
            if f.name.startswith(_REDIS_PASSWORD)
        }
        return cls(**tokens, **keys, **macs, **passwords)

    def values(self) -> list[str]:
        return list(asdict(self).values())

    def redis_passwords(self) -> dict[str, str]:
        """Redis user -> its password (what redis_acl.start needs)."""
        return {
            name.removeprefix(_REDIS_PASSWORD): value
            for name, value in asdict(self).items()
            if name.startswith(_REDIS_PASSWORD)
        }


# Service -> environment variable -> the secret it carries. A service not listed holds none
# of these; each service also holds its own Redis password, inside RTRL_REDIS_URL (held_by).
SERVICE_SECRETS: dict[str, dict[str, str]] = {
    "analytics": {
        "RTRL_ANALYTICS_QUERY_TOKEN": "analytics_query_token",
        "RTRL_ANALYTICS_EVENT_KEYS": "analytics_event_mac_key",
        "RTRL_ANALYTICS_REWARD_MAC_KEYS": "reward_analytics_mac_key",
    },
    "weight_sync": {
        "RTRL_WEIGHT_SYNC_TOKEN": "weight_sync_publish_token",
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN": "weight_sync_subscribe_token",
    },
    "trainer": {
        "RTRL_WEIGHT_SYNC_TOKEN": "weight_sync_publish_token",
        "RTRL_TRAINER_MANIFEST_SIGNING_KEY": "manifest_signing_key",
        "RTRL_TRAINER_REWARD_MAC_KEYS": "reward_trainer_mac_key",
    },
    "inference": {
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN": "weight_sync_subscribe_token",
        "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY": "rollout_signing_key",
        "RTRL_INFERENCE_ROLLOUT_MAC_KEY": "rollout_mac_key",
    },
    "ingest": {
        "RTRL_INGEST_EVENT_KEY": "event_mac_key",
        "RTRL_INGEST_ANALYTICS_EVENT_KEY": "analytics_event_mac_key",
    },
    "reward_stream": {
        "RTRL_REWARD_TRAINER_MAC_KEY": "reward_trainer_mac_key",
        "RTRL_REWARD_ANALYTICS_MAC_KEY": "reward_analytics_mac_key",
        "RTRL_REWARD_EVENT_KEYS": "event_mac_key",
        "RTRL_REWARD_ROLLOUT_MAC_KEYS": "rollout_mac_key",
    },
}

# Service -> environment variable -> the public half of a key pair it verifies with (not secret).
SERVICE_PUBLIC_KEYS: dict[str, dict[str, str]] = {
    "trainer": {"RTRL_MANIFEST_PUBLIC_KEYS": "manifest_signing_key"},
    "inference": {
        "RTRL_MANIFEST_PUBLIC_KEYS": "manifest_signing_key",
        "RTRL_API_KEY_PUBLIC_KEYS": "api_key_signing_key",
    },
    "ingest": {"RTRL_API_KEY_PUBLIC_KEYS": "api_key_signing_key"},
    "analytics": {
        "RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS": "rollout_signing_key",
        "RTRL_MANIFEST_PUBLIC_KEYS": "manifest_signing_key",
    },
}

API_KEY_SIGNING_VARIABLE = "RTRL_API_KEY_SIGNING_KEY"

# Each service's own settings prefix (its settings class's env_prefix).
SERVICE_PREFIX = {
    "analytics": "RTRL_ANALYTICS_",
    "weight_sync": "RTRL_WEIGHT_SYNC_",
    "trainer": "RTRL_TRAINER_",
    "reward_stream": "RTRL_REWARD_",
    "inference": "RTRL_INFERENCE_",
    "ingest": "RTRL_INGEST_",
}

# What a Python service needs of the operating system's environment.
OS_VARIABLES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "CUDA_VISIBLE_DEVICES",
    }
)


def ensure(state_dir: Path) -> StackSecrets:
    """The state directory's secrets, generated (owner-only) on its first start."""
    path = Path(state_dir) / SECRETS_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _completed(path)
    generated = StackSecrets.generate()
    with os.fdopen(descriptor, "w") as out:
        json.dump(asdict(generated), out)
        out.flush()
        os.fsync(out.fileno())
    return generated


def _completed(path: Path) -> StackSecrets:
    """The file's secrets, with any a newer rtrl needs generated and written beside them."""
    doc = json.loads(path.read_text())
    missing = [f.name for f in fields(StackSecrets) if f.name not in doc]
    if missing:
        fresh = asdict(StackSecrets.generate())
        doc |= {name: fresh[name] for name in missing}
        tmp = path.with_suffix(".tmp")
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            json.dump(doc, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    loaded = load(path.parent)
    assert loaded is not None
    return loaded


def load(state_dir: Path) -> StackSecrets | None:
    path = Path(state_dir) / SECRETS_FILE
    if not path.exists():
        return None
    if path.stat().st_mode & 0o077:
        raise PermissionError(
            f"{path} is readable by others than its owner: chmod 600 it (and rotate what it holds)"
        )
    doc = json.loads(path.read_text())
    return StackSecrets(**{f.name: str(doc[f.name]) for f in fields(StackSecrets)})


def key_authority(state_dir: Path) -> KeyAuthority:
    """The operator's signer of API key records: the embedded stack's own (from the secrets
    file of ``state_dir``), else RTRL_API_KEY_SIGNING_KEY (a production stack's)."""
    stack_secrets = load(state_dir)
    if stack_secrets is not None:
        return KeyAuthority(stack_secrets.api_key_signing_key)
    private = os.environ.get(API_KEY_SIGNING_VARIABLE)
    if not private:
        raise RuntimeError(
            f"no {SECRETS_FILE} in {state_dir} and no {API_KEY_SIGNING_VARIABLE} set: API keys cannot be signed"
        )
    return KeyAuthority(private)


def held_by(service: str) -> set[str]:
    """The StackSecrets fields a service's environment carries: its SERVICE_SECRETS and its
    own Redis user's password."""
    return set(SERVICE_SECRETS.get(service, {}).values()) | {_REDIS_PASSWORD + service}


def _stack_variables() -> frozenset[str]:
    """The shared settings (StackSettings, prefix RTRL_) every service may be given: not the secrets."""
    return frozenset(
        f"RTRL_{name.upper()}"
        for name, field in StackSettings.model_fields.items()
        if field.annotation is not SecretStr
    )


def service_env(
    service: str, environ: Mapping[str, str], stack_secrets: StackSecrets, redis_address: str
) -> dict[str, str]:
    """The whole environment a service process starts with (see the module docstring);
    ``redis_address`` is where the stack's Redis listens, without credentials."""
    shared = _stack_variables()
    prefix = SERVICE_PREFIX.get(service)
    own_secrets = SERVICE_SECRETS.get(service, {})
    secret_names = {name for names in SERVICE_SECRETS.values() for name in names}
    env = {
        name: value
        for name, value in environ.items()
        if name in OS_VARIABLES
        or name in shared
        or (prefix is not None and name.startswith(prefix) and name not in secret_names)
    }
    env.update({name: getattr(stack_secrets, secret) for name, secret in own_secrets.items()})
    env.update(
        {
            name: signing.public_key_of(getattr(stack_secrets, key))
            for name, key in SERVICE_PUBLIC_KEYS.get(service, {}).items()
        }
    )
    # Its own Redis user, over any RTRL_REDIS_URL of the operator's (another Redis, maybe
    # one with no password): a service never reaches Redis as another, nor anonymously.
    password = stack_secrets.redis_passwords()[service]
    env["RTRL_REDIS_URL"] = redis_acl.url(redis_address, service, password)
    return env
