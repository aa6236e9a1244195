"""The one typed configuration object: every knob of milestream, loaded from YAML, overridable by flags.

Sections mirror the stages of the loop. ``load_config`` reads an optional YAML file and applies
``MILESTREAM__SECTION__KEY`` environment variables, then ``section.key=value`` overrides (values parsed
as YAML), then validates the whole tree. So that this file stays readable, the sections of the rollout side
live in config_rollout.py, those of the services in config_services.py and ``distill`` in distill_config.py;
they are imported here, so every section is ``milestream.config.<Name>``.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import Field, SecretStr, ValidationError, field_serializer, field_validator, model_validator

from milestream.config_rollout import (DataConfig, EvalConfig, RewardConfig, RolloutConfig, SandboxConfig,
                                       SourceConfig)
from milestream.config_services import (BrokerConfig, RedisConfig, RouterConfig, Section, SessionsConfig,
                                        VllmConfig, WeightsConfig)
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
