"""The sections of the rollout side: where prompts come from (data), how a sample is scored (reward), how it is
generated (rollout, the tool sandbox), and the held-out evaluation that shares the rollout engines.

Their own module so that config.py does not grow past reading; config.py imports them back, so each is still
``milestream.config.<Name>``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from milestream.config_services import Section


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
    # ...agents:openai_episode: an episode is every leaf of its session (branches, conversations), each a
    # trajectory with the episode's reward; one with more leaves than this fails its sample
    max_leaves: int = Field(8, ge=1)
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
