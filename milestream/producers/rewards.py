"""The reward of a sample (``reward.*``): a built-in verifier, the user's function, or a reward service.

One of, chosen in ``RewardConfig``:

- ``verifier``: ``answer_tag`` (the reasoning-gym demo's scorer), ``math``, ``exact_match``, ``regex``;
- ``fn``: ``fn(sample: RewardSample) -> float | dict[str, float]``, sync or async;
- ``group_fn``: ``fn(samples: list[RewardSample]) -> list[float | dict[str, float]]`` (pairwise, reward models);
- ``url``: a reward service. It gets ``POST {"samples": [RewardSample as JSON, ...]}`` (one group) and
  answers ``{"rewards": [float | {name: float}, ...]}`` in the same order; timeouts, connection errors and
  5xx are retried ``reward.retries`` times, at most ``reward.max_concurrency`` requests are in flight.

A dict reward trains on its ``reward.key`` component, or on the sum of its components when no key is set;
every component is reported as ``reward/<name>`` in the worker's metrics. A reward that raises, times
out, or returns something else is a ``Reward`` with ``error`` set: the worker records it on the
trajectory (``reward_error``) and the processor drops the group with that reason, never a silent zero.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import aiohttp

from milestream.config import Config, import_path
from milestream.producers.data import prompt_messages, source_named
from milestream.producers.tasks import score, tag_score
from milestream.schemas.records import Prompt

# ---- the contract -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSample:
    """What a reward sees of one sample."""

    source: str  # the data source's name (data.sources[].name)
    prompt: str  # the prompt as text (for a chat prompt: the last user message)
    messages: tuple[Mapping[str, Any], ...]  # the prompt as the chat messages the policy saw (system included)
    response: str  # what the policy wrote (after data.assistant_prefill), or an episode's final answer
    label: str | None
    metadata: Mapping[str, Any]  # the data.metadata_keys columns; for a reasoning-gym task, its entry
    prompt_ids: tuple[int, ...] = ()
    response_ids: tuple[int, ...] = ()
    finish_reason: str = "stop"  # stop | length | abort
    turns: int = 1
    tool_calls: int = 0

    @classmethod
    def of(cls, cfg: Config, prompt: Prompt, label: str | None, metadata: Mapping[str, Any], **generated: Any
           ) -> "RewardSample":
        """The sample of ``prompt`` as the policy saw it (its chat messages); ``generated``: response, ids,
        finish reason, turns, tool calls."""
        return cls(source=prompt.dataset, prompt=prompt.question, messages=tuple(prompt_messages(cfg, prompt)),
                   label=label, metadata=metadata, **generated)


@dataclass(frozen=True)
class Reward:
    value: float  # what trains
    components: Mapping[str, float] = field(default_factory=dict)  # of a dict reward, each a metric
    error: str = ""  # why there is no reward: the group is dropped (reason reward_error)


class RewardModel(Protocol):
    """Scores a group's samples; ``per_group``: it needs the whole group at once."""

    per_group: bool

    async def __call__(self, samples: Sequence[RewardSample]) -> list[Reward]: ...


def as_reward(raw: Any, key: str | None) -> Reward:
    """A user's float or dict of floats as a Reward; anything else raises TypeError."""
    if isinstance(raw, Mapping):
        components = {str(name): _number(value, f"component {name!r}") for name, value in raw.items()}
        if key is not None and key not in components:
            raise TypeError(f"reward.key {key!r} is not among the components {sorted(components)}")
        return Reward(components[key] if key is not None else sum(components.values()), components)
    return Reward(_number(raw, "reward"))


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{what} is {value!r}, not a finite number")
    return float(value)


# ---- built-in verifiers -----------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def math_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else the last number of the text."""
    boxed = list(_BOXED.finditer(text))
    if boxed:
        start = depth = boxed[-1].end()
        depth = 1
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start:end]
        return None
    numbers = _NUMBER.findall(_untex(text))
    return numbers[-1] if numbers else None


def _untex(text: str) -> str:
    """LaTeX fractions as ``a/b`` and ``\\%`` as ``%``."""
    return _FRAC.sub(r"\1/\2", text).replace("\\%", "%")


def math_value(text: str) -> Fraction | str:
    """A number with commas, ``$``, spaces, trailing zeros, ``%``, ``a/b`` and ``\\frac{a}{b}`` normalised;
    text that is no number comes back stripped, to be compared as text."""
    plain = _untex(text).replace(",", "").replace("$", "").replace(" ", "").removeprefix("+")
    percent = plain.endswith("%")
    try:
        value = Fraction(plain.removesuffix("%"))
    except (ValueError, ZeroDivisionError):
        return text.strip()
    return value / 100 if percent else value


def math_equal(answer: str | None, label: str | None) -> bool:
    return answer is not None and label is not None and math_value(answer) == math_value(label)


def math_verifier(sample: RewardSample, cfg: Config) -> float:
    return float(math_equal(math_answer(sample.response), sample.label))


def exact_match_verifier(sample: RewardSample, cfg: Config) -> float:
    return float(sample.label is not None and sample.response.strip() == sample.label.strip())


def regex_verifier(sample: RewardSample, cfg: Config) -> float:
    """1 when ``reward.pattern`` occurs in the response and its first group (if it has one) is the label."""
    match = re.search(cfg.reward.pattern, sample.response)
    if match is None:
        return 0.0
    return float(not match.groups() or (match.group(1) or "").strip() == (sample.label or "").strip())


def answer_tag_verifier(sample: RewardSample, cfg: Config) -> float:
    """The demo's scorer: the last number in the first closed answer tag (reasoning-gym's verdict, or
    equal to the label), plus ``data.format_reward`` for closing the tag; no closed tag scores 0."""
    task = source_named(cfg, sample.source).task_data
    if task is not None:
        return score(sample.response, dict(sample.metadata), task)
    return tag_score(sample.response, cfg.data, lambda answer: float(math_equal(answer, sample.label)))


VERIFIERS: dict[str, Callable[[RewardSample, Config], float]] = {
    "answer_tag": answer_tag_verifier, "math": math_verifier, "exact_match": exact_match_verifier,
    "regex": regex_verifier,
}


def default_verifier(cfg: Config) -> str:
    """answer_tag for reasoning-gym data, math against the label for a user data set."""
    if cfg.reward.verifier:
        return cfg.reward.verifier
    return "answer_tag" if all(s.task for s in cfg.data.data_sources()) else "math"


# ---- reward models ----------------------------------------------------------------------------------


class SampleFunction:
    """A function of one sample (a verifier or ``reward.fn``): each sample scored on its own."""

    per_group = False

    def __init__(self, fn: Callable[[RewardSample], Any], key: str | None, timeout_s: float | None) -> None:
        self.fn, self.key, self.timeout_s = fn, key, timeout_s

    async def __call__(self, samples: Sequence[RewardSample]) -> list[Reward]:
        return list(await asyncio.gather(*(self._one(sample) for sample in samples)))

    async def _one(self, sample: RewardSample) -> Reward:
        return await _guarded(lambda: self.fn(sample), self.key, self.timeout_s)


class GroupFunction:
    """``reward.group_fn``: the whole group in one call."""

    per_group = True

    def __init__(self, fn: Callable[[list[RewardSample]], Any], key: str | None, timeout_s: float) -> None:
        self.fn, self.key, self.timeout_s = fn, key, timeout_s

    async def __call__(self, samples: Sequence[RewardSample]) -> list[Reward]:
        return await _guarded(lambda: self.fn(list(samples)), self.key, self.timeout_s, many=len(samples))


class RewardService:
    """``reward.url``: one POST per group (see the module docstring for the JSON)."""

    per_group = True

    def __init__(self, url: str, key: str | None, timeout_s: float, retries: int, max_concurrency: int) -> None:
        self.url, self.key, self.timeout_s, self.retries = url, key, timeout_s, retries
        self.max_concurrency = max_concurrency
        self._limit: asyncio.Semaphore | None = None  # made on first use, in the worker's event loop

    async def __call__(self, samples: Sequence[RewardSample]) -> list[Reward]:
        self._limit = self._limit or asyncio.Semaphore(self.max_concurrency)
        body = {"samples": [asdict(sample) for sample in samples]}
        async with self._limit:
            return await _guarded(lambda: self._post(body), None, None, many=len(samples))

    async def _post(self, body: dict) -> list[Reward]:
        failure = ""
        for attempt in range(self.retries + 1):
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with aiohttp.ClientSession(timeout=timeout) as session, session.post(self.url, json=body) as reply:
                    if reply.status < 500:
                        reply.raise_for_status()  # a 4xx is the request's fault: another try would not help
                        return self._parse(await reply.json(), len(body["samples"]))
                    failure = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            except (asyncio.TimeoutError, aiohttp.ClientConnectionError) as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else f"timed out after {self.timeout_s}s"
            if attempt < self.retries:
                await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
        raise RuntimeError(f"reward.url {self.url}: {self.retries + 1} tries failed, the last with {failure}")

    def _parse(self, reply: Any, expected: int) -> list[Reward]:
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list) or len(rewards) != expected:
            raise TypeError(f"reward.url {self.url} answered {json.dumps(reply)[:200]}, not "
                            f"{{\"rewards\": [...]}} with {expected} entries")
        return [as_reward(value, self.key) for value in rewards]


async def _guarded(call: Callable[[], Any], key: str | None, timeout_s: float | None, many: int = 0) -> Any:
    """The call's reward(s); its exception or timeout as Reward(s) with ``error`` set.

    ``many``: the call scores that many samples (a list comes back); 0: one sample.
    """
    try:
        raw = call()
        while inspect.isawaitable(raw):  # a sync wrapper may hand back the coroutine of an async __call__
            raw = await asyncio.wait_for(raw, timeout_s)
        if many and raw and isinstance(raw[0], Reward):
            return raw
        if many:
            if not isinstance(raw, Sequence) or len(raw) != many:
                raise TypeError(f"returned {raw!r:.200}, not a list of {many} rewards")
            return [as_reward(value, key) for value in raw]
        return as_reward(raw, key)
    except asyncio.TimeoutError:
        error = Reward(0.0, error=f"timed out after {timeout_s}s")
    except Exception as exc:  # the user's code: whatever it raises is this sample's reward error
        error = Reward(0.0, error=f"{type(exc).__name__}: {exc}"[:500])
    return [error] * many if many else error


def load_reward(cfg: Config) -> RewardModel:
    """The configured reward; an import path that does not resolve raises ValueError naming it."""
    reward = cfg.reward
    if reward.fn:
        return SampleFunction(_off_the_loop(import_path(reward.fn, "reward.fn")), reward.key, reward.timeout_s)
    if reward.group_fn:
        return GroupFunction(_off_the_loop(import_path(reward.group_fn, "reward.group_fn")), reward.key, reward.timeout_s)
    if reward.url:
        return RewardService(reward.url, reward.key, reward.timeout_s, reward.retries, reward.max_concurrency)
    verifier = VERIFIERS[default_verifier(cfg)]
    return SampleFunction(lambda sample: verifier(sample, cfg), None, None)


def _off_the_loop(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's sync function runs in a thread, so it can be timed out and never blocks generation."""
    if inspect.iscoroutinefunction(fn):
        return fn
    return lambda *args: asyncio.to_thread(fn, *args)
