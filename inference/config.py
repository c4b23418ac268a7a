"""Settings of an inference worker (env prefix ``RTRL_INFERENCE_``).

Connections (Kafka, Redis, weight_sync, instance) come from rtrl.config.StackSettings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from rtrl import signing
from rtrl.config import MacKey, RequiredSecret, Settings, SigningKey, StackSettings
from rtrl.event_time import EventTimeWindow
from rtrl.http_limits import HTTPListener
from rtrl.tls import TLSListener


class InferenceSettings(Settings, HTTPListener, TLSListener):
    model_config = SettingsConfigDict(env_prefix="RTRL_INFERENCE_")

    bind_host: str = "127.0.0.1"
    """Address the HTTP API binds to (``0.0.0.0`` in a container)."""

    http_port: int = Field(8090, ge=0, le=65535)
    """Port of the HTTP API (``POST /v1/completions``, ``GET /healthz``); 0 picks a free one."""

    max_batch: int = Field(32, ge=1, le=1024)
    """Most requests of one arm decoded together in a micro-batch."""

    batch_wait_ms: float = Field(2.0, ge=0, le=1000)
    """How long a batch waits for more requests after its first one before it starts."""

    max_tokens: int = Field(48, ge=1, le=1_000_000)
    """Completion length when a request does not say (capped by the policy's context)."""

    temperature: float = Field(1.0, ge=0, le=5)
    """Sampling temperature when a request does not say; 0 is greedy."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass when a request does not say; 1 samples the whole distribution."""

    trained_temperature_min: float = Field(0.5, gt=0, le=5)
    """A completion sampled colder than this is served but not recorded as a rollout: the trainer
    learns only from sampling the server considers the policy's own (the caller does not pick it)."""

    trained_temperature_max: float = Field(1.5, gt=0, le=5)
    """A completion sampled hotter than this is served but not recorded (5.0 is noise, not the policy)."""

    trained_top_p_min: float = Field(0.9, gt=0, le=1)
    """A completion with a smaller nucleus than this is served but not recorded."""

    auth_required: bool = True
    """Refuse completions without a valid API key of scope ``completions`` (rtrl/api_keys.py).
    Off only for local experiments: then nothing says who was served a rollout."""

    key_cache_ttl_s: float = Field(1.0, gt=0, le=300)
    """How long an API key record is used before it is read again (a revocation takes this long)."""

    max_request_bytes: int = Field(256 * 1024, ge=1024, le=64 * 1024 * 1024)
    """The largest request body the server reads, whatever the key's budget (413 past it)."""

    served_ttl_s: int = Field(2 * 3600, ge=60, le=7 * 24 * 3600)
    """How long the gateway remembers which client a rollout was served to (a Redis key of
    ~330 B per completion): telemetry about it from another client's key is refused (the
    joiner checks it regardless), and telemetry about a rollout with no such mark is
    stamped as about one no worker served (the joiner drops it when its window closes). Needed while that
    telemetry can still change a reward: at least RTRL_REWARD_MAX_WAIT_S (3,960 s, which
    covers a trajectory's whole life), hence 2 h. Later events are kept by the analytics
    sink as before, but no longer bound to the client; raise it to keep that binding longer."""

    rollout_inline_bytes: int = Field(8 * 1024, ge=1024, le=8 << 20)
    """A rollout record larger than this travels without its bulk (tokens, log-probs,
    segments, texts, routes), which goes to the rollout bulk store first (rtrl/bulk.py;
    RTRL_ROLLOUT_BULK_URL): the joiner then holds, and the reward copies, a record of about
    the same size however long the trajectory. A single-turn completion of a dense model
    stays well under it."""

    rollout_signing_key: SigningKey = SecretStr("")
    """The workers' Ed25519 private key for rollout records (base64url, rtrl/signing.py):
    every rollout is signed with it, for the readers that must not be able to forge one
    (the analytics sink: RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS). No default: the server
    refuses to start without one (`rtrl up` generates it)."""

    rollout_mac_key: MacKey = SecretStr("")
    """The key (base64url, 32 bytes) of the MAC every rollout carries for the joiner, which
    joins only rollouts whose MAC verifies (RTRL_REWARD_ROLLOUT_MAC_KEYS): ~3 µs to check
    where the signature costs ~110 µs (rtrl/signing.py says why it is enough). No default:
    the server refuses to start without one (`rtrl up` generates it)."""

    treatment_fraction: float = Field(0.5, ge=0, le=1)
    """Share of user ids (by a stable hash) served by the treatment arm."""

    swap_policy: Literal["keep", "recompute"] = "keep"
    """What in-flight sequences do when new weights go live between decode steps: keep
    the KV cache computed under the old version, or re-prefill it under the new one."""

    trajectory_idle_s: float = Field(300.0, gt=0, le=24 * 3600)
    """An agent's trajectory with no turn for this long ends, and its record is written
    (inference/sessions.py); its next turn starts a new trajectory."""

    trajectory_max_s: float = Field(3600.0, gt=0, le=7 * 24 * 3600)
    """A trajectory ends this long after its first turn (at its next idle moment), and its
    record is written: its telemetry may arrive before the record, and the joiner waits
    RTRL_REWARD_MAX_WAIT_S for a record, which must cover this plus trajectory_idle_s."""

    trajectory_max_turns: int = Field(512, ge=1, le=100_000)
    """A trajectory ends after this many assistant turns."""

    trajectory_max_tokens: int = Field(0, ge=0)
    """A trajectory ends once it holds this many tokens; 0: the policy's context length."""

    session_kv_tokens: int = Field(262_144, ge=0)
    """Positions of agents' keys and values the embedded engine keeps between their turns,
    per arm (inference/session_kv.py): a kept turn prefills only its new tokens. The least
    recently used go first; 0 keeps none (every turn prefills its whole history)."""

    max_trajectories: int = Field(1024, ge=1, le=1_000_000)
    """Open trajectories one worker keeps, over every client. Past it, the newcomer's client's
    own least recently used idle trajectory ends; never another client's: with none of its
    own idle, the newcomer is refused with 503 (Retry-After: when the sweep next frees one)."""

    max_trajectories_per_client: int = Field(64, ge=1, le=1_000_000)
    """Open trajectories one client (API key's client id) keeps on one worker: its share.
    Past it, the client's own least recently used idle trajectory ends (its next turn is told,
    409); with none idle, the new one is refused with 429. So one client fills at most this
    many of the worker's max_trajectories; raise it for a client that runs many agents."""

    ready_timeout_s: float = Field(30.0, gt=0, le=3600)
    """How long a request waits for its arm's first weights before failing with 503."""

    follow_weights: bool = True
    """Subscribe to weight_sync for both arms. Off only when weights are staged in-process."""

    produce_timeout_ms: int = Field(10_000, ge=100)
    """librdkafka ``message.timeout.ms``: a rollout record not acked by then fails the request."""

    model_name: str = ""
    """Name recorded in rollout records; empty means ``rtrl-policy-<policy config fingerprint>``."""

    heartbeat_interval_s: float = Field(1.0, gt=0, le=5)
    """Seconds between heartbeats (rtrl:hb:inference:<instance>)."""

    shutdown_grace_s: float = Field(10.0, ge=0, le=120)
    """On SIGTERM, in-flight requests get this long to finish before the server closes."""

    client_ts_max_future_s: float = Field(300.0, ge=0, le=24 * 3600)
    """A request's ``client_ts_ms`` may be at most this far ahead of the worker's clock
    (client clock skew); a later one is refused with 400 naming the field."""

    client_ts_max_age_s: float = Field(7 * 24 * 3600.0, gt=0, le=365 * 24 * 3600)
    """A request's ``client_ts_ms`` may be at most this far behind the worker's clock; an
    older one (or 0, or negative) is refused with 400 naming the field."""

    backend: Literal["embedded", "sglang"] = "embedded"
    """Who generates: the embedded torch engine (weights followed from weight_sync by this
    process), or SGLang servers (weights streamed into them by their sidecars)."""

    sglang_urls: str = ""
    """``backend=sglang``: the SGLang server of each arm, ``arm=url`` comma separated
    (``control=http://sglang-control:30000,treatment=http://sglang:30000``)."""

    sglang_max_concurrency: int = Field(64, ge=1, le=4096)
    """``backend=sglang``: requests in flight to SGLang at once (SGLang batches them)."""

    sglang_timeout_s: float = Field(300.0, gt=0)
    """``backend=sglang``: longest a /generate may take."""

    sglang_api_key: SecretStr = SecretStr("")
    """``backend=sglang``: the servers' ``--api-key`` (generation only; weight swaps take the
    sidecars' admin key)."""

    def client_ts_window(self) -> EventTimeWindow:
        return EventTimeWindow.of_seconds(self.client_ts_max_future_s, self.client_ts_max_age_s)

    def rollout_seal(self) -> signing.Seal:
        """What authenticates a rollout: the workers' signature (for every reader that must
        not be able to forge one) and the joiner's MAC."""
        return signing.Seal(
            signing.Signer(self.rollout_signing_key.get_secret_value(), signing.Purpose.ROLLOUT),
            signing.MacSigner(self.rollout_mac_key.get_secret_value(), signing.Purpose.ROLLOUT),
        )

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What ``python -m rtrl.inference`` does not start without."""
        required = [
            RequiredSecret(
                self,
                "rollout_signing_key",
                "the worker signs every rollout it records (rtrl up generates it)",
            ),
            RequiredSecret(
                self,
                "rollout_mac_key",
                "the worker authenticates every rollout to the joiner (rtrl up generates it; "
                "python -m rtrl.signing prints one)",
            ),
        ]
        if self.auth_required:
            required.append(
                RequiredSecret(
                    stack,
                    "api_key_public_keys",
                    "the serving API accepts only API keys the operator signed (rtrl up derives it)",
                )
            )
        # SGLang's sidecars follow the weights for the sglang backend; they need these then.
        if self.follow_weights and self.backend == "embedded":
            required += [
                RequiredSecret(
                    stack,
                    "weight_sync_subscribe_token",
                    "the worker follows weight_sync's versions with it (rtrl up generates it)",
                ),
                RequiredSecret(
                    stack,
                    "manifest_public_keys",
                    "the worker applies only versions the trainer signed (rtrl up derives it)",
                ),
            ]
        return required

    def sglang_url_map(self) -> dict[str, str]:
        """``sglang_urls`` as arm -> url."""
        urls = {}
        for entry in filter(None, (part.strip() for part in self.sglang_urls.split(","))):
            arm, sep, url = entry.partition("=")
            urls[arm.strip()] = url.strip()
        return urls

    @model_validator(mode="after")
    def _served_marks_outlive_trajectories(self) -> InferenceSettings:
        """A trajectory's mark is written at its first turn; its telemetry may come until it
        ends, so the mark must outlive the longest trajectory and its idle close."""
        longest = self.trajectory_max_s + self.trajectory_idle_s + 60
        if self.served_ttl_s < longest:
            raise ValueError(
                f"served_ttl_s ({self.served_ttl_s}) must cover trajectory_max_s plus "
                f"trajectory_idle_s and a minute ({longest:g} s)"
            )
        return self

    @model_validator(mode="after")
    def _defaults_fit_each_other(self) -> InferenceSettings:
        if self.temperature == 0 and self.top_p < 1:
            raise ValueError("top_p has no effect with temperature 0; leave it at 1")
        if self.backend == "sglang":
            urls = self.sglang_url_map()
            unknown = set(urls) - {"control", "treatment"}
            if (
                not urls
                or unknown
                or not all(url.startswith(("http://", "https://")) for url in urls.values())
            ):
                raise ValueError(
                    "backend=sglang needs RTRL_INFERENCE_SGLANG_URLS as arm=http://host:port pairs "
                    f"for control and/or treatment, got {self.sglang_urls!r}"
                )
        return self
