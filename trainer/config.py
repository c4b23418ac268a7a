"""Trainer settings (env prefix ``RTRL_TRAINER_``). Imports no torch, so config
errors surface before the heavy imports."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rtrl.config import MacKeys, RequiredSecret, Settings, SigningKey, StackSettings
from rtrl.plugins import check_spec


class TrainerSettings(Settings):
    """How the trainer batches production rollouts and steps the treatment policy."""

    model_config = SettingsConfigDict(env_prefix="RTRL_TRAINER_")

    lr: float = Field(1e-4, gt=0, le=1e-2)
    """AdamW learning rate. 3e-4 was measured noisy and 1e-3 collapsed the policy at batch 64."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay; decay pulls toward zero, not toward the warm start, so it stays off."""

    batch_size: int = Field(64, ge=1, le=4096)
    """Rollouts per step when traffic is plentiful."""

    micro_batch_tokens: int = Field(32768, ge=256)
    """Most padded positions in one forward and backward: a step's batch is split into
    micro-batches of at most this many (its longest rollouts first; one longer than this
    is a micro-batch of its own) and their gradients added up, the same step as one forward
    would take. It bounds the activations and logits a step holds: a batch of long agent
    trajectories trains in the memory of its longest one (a one-process trainer)."""

    steps_per_candidate: int = Field(1, ge=1, le=64)
    """Most optimizer steps, of at most batch_size rollouts each, in one candidate. The eval gate judges and
    weight_sync ships once per candidate, so when more than a batch is pending (traffic outran the trainer)
    it catches up with one gate per few steps instead of one per step; the learning rate and batch size of
    each step stay the same."""

    overlap_eval: bool = True
    """Judge each candidate on a thread of its own while the next one trains on top of it (a one-process
    trainer; a sharded one judges inline). Either way only judged weights ship: the next candidate is
    journaled and judged only after this one's verdict, and is trained again if this one is refused."""

    when_behind: Literal["catch_up", "shed"] = "catch_up"
    """What the trainer does when rewards arrive faster than it trains. ``catch_up`` trains on every one
    (lossless): it reads at most a candidate's worth (batch_size × steps_per_candidate), the rest waits in
    Kafka, and a backlog is worked off with one gate per steps_per_candidate batches, however stale the
    trainer's data grows meanwhile. ``shed`` trains on the freshest: it reads everything the broker holds
    and keeps only the newest candidate's worth, dropping the older rewards (counted as ``shed`` and
    committed past), so what it trains on is never more than one candidate's cycle old. The embedded stack
    sheds: on 2 cores its trainer gets about half a core and cannot take all of the demo's traffic."""

    min_batch: int = Field(16, ge=1)
    """Fewest rollouts worth a step; with fewer, keep waiting."""

    max_wait_s: float = Field(1.0, gt=0)
    """Once min_batch rollouts are pending, step after at most this long even if batch_size was not reached."""

    max_staleness: int = Field(8, ge=0)
    """Drop rollouts whose oldest token came from a version older than current − max_staleness."""

    is_cap: float = Field(2.0, ge=1.0)
    """Truncation of the importance ratio π_current/π_behaviour (per token)."""

    router_replay: bool = True
    """For a mixture-of-experts policy, route the trainer's forwards (the policy's and the
    reference's) through the experts the sampler chose (RolloutRecord.router_choices,
    rtrl/moe.py): re-routed, a nearly tied pair of experts flips on rounding alone and moves
    log-probs by nats, not by the rounding. Off re-routes, to measure what replay removes. A
    dense policy, and a batch with a rollout that carries no routes, is re-routed either way."""

    mismatch_threshold: float = Field(0.05, gt=0, le=1)
    """|Δ log p| in nats (trainer's minus sampler's, on the tokens sampled by the weights a step
    starts from) above which a token counts toward the reported mismatch share: the ratio
    π_trainer/π_sampler outside about [0.95, 1.05]. Same-dtype float32 agrees to ~1e-6 and bf16
    rounding moves a log-prob by about 1e-3 to 1e-2, so a healthy stack puts few tokens over
    it; a top-p nucleus below 0.95 (which the trainer does not apply) or wrong weights put many."""

    mismatch_kept_versions: int = Field(9, ge=0, le=64)
    """Published versions whose weights the trainer keeps to measure the mismatch on the
    tokens each sampled (trainer/kept_versions.py): before each step, one forward without
    gradient under the kept version that sampled most of its batch, over up to 8 of the
    rows it sampled. max_staleness + 1
    covers every version a trained token may come from. 0: only a step that starts from a
    published version's weights measures it (rarely, once training runs ahead)."""

    mismatch_kept_mb: int = Field(1024, ge=0)
    """At most this much memory (MiB) of kept weights: fewer versions of a larger model."""

    kl_coef: float = Field(0.01, ge=0)
    """Weight of the per-token k1 penalty toward the warm start (the control policy)."""

    std_normalize: bool = False
    """Divide advantages by their group's reward std (never for a group whose std is zero)."""

    baseline: Literal["group", "context"] = "group"
    """What a rollout's reward is compared with (trainer/baseline.py). ``group``: the other rollouts
    of its prompt in the batch (leave-one-out), else the batch mean. ``context``: leave-one-out where
    the batch holds its prompt more than once, else a running mean of the rewards of earlier rollouts
    in its context (context_key), kept across steps and restarts: for traffic whose prompts are
    unique (`rtrl demo --unique-prompts` uses it)."""

    context_key: str = ""
    """With baseline=context, the product's context of a rollout (task type, repository...) as a
    plug-in ``module:callable`` taking the RolloutRecord and returning a string ("" for none);
    empty: none (the embedded demo names the simulated product's, which reads the project tag
    from the prompt). Asked only for a rollout whose request sent no ``context_key`` to the
    serving API: the key a request sends, carried in the record, comes first."""

    baseline_window: float = Field(64.0, ge=1)
    """Rewards a context's running mean averages over (an exponential moving average of about this
    many, a plain mean until it has them): shorter follows a policy that improves quickly, longer is
    less noisy."""

    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""

    checkpoint_every: int = Field(50, ge=1)
    """Steps between checkpoints (one is also written on shutdown)."""

    seed: int = Field(0, ge=0)
    """Seed of the warm start (part of its cache key) and of torch."""

    keyframe_every: int = Field(20, ge=1)
    """Every n-th published version is a full snapshot instead of a delta."""

    poll_timeout_s: float = Field(0.1, gt=0, le=5)
    """Longest a single Kafka poll blocks; bounds how late max_wait_s and shutdown are noticed."""

    reward_mac_keys: MacKeys = SecretStr("")
    """The key(s) of the MAC the joiner puts on every reward for the trainer (base64url, 32
    bytes each; rtrl/signing.py), comma-separated (more than one while keys rotate): a reward
    whose MAC does not verify under one is never trained on: dropped as ``unsigned`` or
    ``forged``, counted and dead-lettered. A key the joiner shares with the trainer alone,
    so holding it lets the trainer forge rewards only to itself. No default: the trainer
    refuses to start without one (`rtrl up` generates it)."""

    manifest_signing_key: SigningKey = SecretStr("")
    """The trainer's Ed25519 private key for weight manifests (base64url,
    weight_sync/provenance.py): every version it publishes is signed with it, and workers
    apply only versions that verify against its public key (RTRL_MANIFEST_PUBLIC_KEYS).
    No default: the trainer refuses to start without one (`rtrl up` generates it)."""

    consumer_group: str = "trainer"
    """Kafka consumer group on the reward topic."""

    topic: str = "rl.reward.v1"
    """Reward topic to train on (a replay topic, rl.reward.replay.<version>, to train on a re-scored history)."""

    initial_policy: str = ""
    """The policy both arms start from when RTRL_MODEL_DIR names none, as a plug-in
    ``module:callable`` (trainer.plugins.InitialPolicy); the embedded stack names the demo's
    warm start (rtrl.simulator.warmstart:demo_policy). One of the two is required."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's weights and compute (what it publishes is float32 either way: workers
    check every version against the checkpoint's names and shapes)."""

    device: str = "cpu"
    """torch device the trainer runs on (``cpu``, ``cuda``, ``cuda:1``...)."""

    eval_suite: str = ""
    """The eval gate's held-out suite, as a plug-in ``module:callable``
    (trainer.plugins.SuiteFactory); empty: the label-free gate (trainer/label_free.py), unless
    eval_prompts names a prompt file. The embedded demo names the simulated product's tasks
    (rtrl.simulator.suite:demo_suite)."""

    eval_prompts: Path | None = None
    """Your eval gate's held-out cases: a JSON Lines file, one ``{"messages": [...]}`` or
    ``{"prompt": "..."}`` per line (trainer/prompt_suite.py); with it, eval_checker
    judges each completion and eval_suite is not used."""

    eval_checker: str = ""
    """With eval_prompts: the checker, a plug-in ``module:callable`` taking ``(case: dict,
    completion: str) -> bool``."""

    eval_tasks: int = Field(128, ge=8, le=4096)
    """Held-out tasks the eval gate samples one completion for, per candidate."""

    eval_max_new_tokens: int = Field(48, ge=8, le=512)
    """Longest eval completion; one that does not end by then fails the checkers."""

    eval_tolerance: float = Field(0.1, ge=0, le=1)
    """Largest drop of an eval checker's score (vs the published version and vs control) a candidate may
    show and still ship. Measured on 128 tasks: benign steps at lr 1e-4 moved a score by up to 0.06; one
    step at lr 1e-3 on rewards that pay for broken code dropped well_formed from 0.94 to 0.55."""

    dedup_capacity: int = Field(200_000, ge=1000)
    """How many recent rollout_ids are remembered to refuse training on one twice."""

    reward_window_steps: int = Field(20, ge=1)
    """Steps over which the heartbeat's reward_mean is averaged."""

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What ``python -m rtrl.trainer`` does not start without."""
        return [
            RequiredSecret(
                self,
                "manifest_signing_key",
                "the trainer signs every version it publishes (rtrl up generates it)",
            ),
            RequiredSecret(
                self,
                "reward_mac_keys",
                "the trainer trains only on rewards the joiner authenticated "
                "(rtrl up generates the key; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                stack,
                "weight_sync_token",
                "the trainer publishes its versions to weight_sync with it (rtrl up generates it)",
            ),
        ]

    @field_validator("initial_policy", "eval_suite", "context_key")
    @classmethod
    def _plugin_spec(cls, spec: str) -> str:
        return spec and check_spec(spec)

    @model_validator(mode="after")
    def _eval_checker_with_prompts(self) -> TrainerSettings:
        if self.eval_prompts is not None:
            if not self.eval_prompts.is_file():
                raise ValueError(f"eval_prompts {self.eval_prompts} is not a file")
            check_spec(self.eval_checker)
        return self

    @model_validator(mode="after")
    def _min_batch_fits(self) -> TrainerSettings:
        if self.min_batch > self.batch_size:
            raise ValueError(
                f"min_batch ({self.min_batch}) must not exceed batch_size ({self.batch_size})"
            )
        return self
