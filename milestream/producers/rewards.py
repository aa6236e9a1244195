"""The reward of a sample (``reward.*``): a built-in verifier, the user's function, or a reward service.

One of, chosen in ``RewardConfig``:

- ``verifier``: ``answer_tag`` (the reasoning-gym demo's scorer), ``math``, ``exact_match``, ``regex``;
- ``fn``: ``fn(sample: RewardSample) -> float | dict[str, float]``, sync or async (an episode's whole
  conversation is ``sample.transcript``);
- ``group_fn``: ``fn(samples: list[RewardSample]) -> list[float | dict[str, float]]`` (pairwise, reward models);
- ``url``: a reward service. It gets ``POST {"samples": [RewardSample as JSON, ...]}`` (one group) and
  answers ``{"rewards": [float | {name: float}, ...]}`` in the same order; timeouts, connection errors and
  5xx are retried ``reward.retries`` times, at most ``reward.max_concurrency`` requests are in flight.

A dict reward trains on its ``reward.key`` component, or on the sum of its components when no key is set;
every component is reported as ``reward/<name>`` in the worker's metrics. A reward that raises, times
out, or returns something else is a ``Reward`` with ``error`` set: the worker records it on the
trajectory (``reward_error``) and the processor drops the group with that reason, never a silent zero.

A verifier, ``fn`` and ``group_fn`` run in reward processes (infra/process_pool.py), never on the worker's
event loop: at most ``reward.max_concurrency`` calls at once, each ended after ``reward.timeout_s`` by
killing its process (a thread could not be stopped). A user's function is imported afresh in those
processes: what it keeps in globals is per process. The ``math`` verifier does no big-number arithmetic
on the model's say-so: a number longer than ``MAX_NUMBER_CHARS`` or with an exponent beyond
``MAX_EXPONENT`` is compared as text (``\\boxed{1e1000000000}`` would take hours as a ``Fraction``).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import aiohttp

from milestream.config import Config, import_path
from milestream.infra.process_pool import ProcessFailed, ProcessPool
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
    # a multi-turn episode's whole conversation (system and prompt first; assistant turns with their tool_calls,
    # tool results); empty for a single completion
    transcript: tuple[Mapping[str, Any], ...] = ()

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
_EXPONENT = re.compile(r"e([-+]?\d+(?:_\d+)*)\s*$", re.IGNORECASE)  # as Fraction reads one
MAX_NUMBER_CHARS = 200  # a longer answer is compared as text: its digits are not worth a big-number sum
MAX_EXPONENT = 400  # past float's range; Fraction("1e1000000000") would compute 10**1000000000


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
    text that is no number, or a number too long or too large to be worth big-number arithmetic
    (``MAX_NUMBER_CHARS``, ``MAX_EXPONENT``), comes back stripped, to be compared as text."""
    plain = _untex(text).replace(",", "").replace("$", "").replace(" ", "").removeprefix("+")
    number = plain.removesuffix("%")
    exponent = _EXPONENT.search(number)
    if len(plain) > MAX_NUMBER_CHARS or (exponent is not None and abs(int(exponent.group(1))) > MAX_EXPONENT):
        return text.strip()
    try:
        value = Fraction(number)
    except (ValueError, ZeroDivisionError):
        return text.strip()
    return value / 100 if number != plain else value


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


class PooledReward:
    """A verifier, ``reward.fn`` or ``reward.group_fn`` (for a group: the whole group in one call), run in
    reward processes (infra/process_pool.py): off the worker's event loop, at most ``reward.max_concurrency``
    calls at once, each ended by killing its process after ``reward.timeout_s``."""

    def __init__(self, cfg: Config) -> None:
        self.per_group = bool(cfg.reward.group_fn)
        self.timeout_s = cfg.reward.timeout_s
        self._pool = ProcessPool(functools.partial(_scorer, cfg), cfg.reward.max_concurrency, self.timeout_s,
                                 preload=[__name__])

    async def __call__(self, samples: Sequence[RewardSample]) -> list[Reward]:
        if self.per_group:
            return await self._scored(list(samples), many=len(samples))
        return list(await asyncio.gather(*(self._scored([sample], many=0) for sample in samples)))

    async def _scored(self, samples: list[RewardSample], many: int) -> Reward | list[Reward]:
        try:
            return await self._pool(samples)
        except asyncio.TimeoutError:
            return _errors(f"timed out after {self.timeout_s}s", many)
        except ProcessFailed as exc:
            return _errors(f"the reward's process failed: {exc}", many)


def _scorer(cfg: Config) -> Callable[[list[RewardSample]], Awaitable[Reward | list[Reward]]]:
    """In a reward process: the configured reward of a list of samples (a group, or one sample)."""
    reward = cfg.reward
    if reward.group_fn:
        group_fn = import_path(reward.group_fn, "reward.group_fn")
        return lambda samples: _settled(lambda: group_fn(samples), reward.key, many=len(samples))
    if reward.fn:
        fn = import_path(reward.fn, "reward.fn")
        return lambda samples: _settled(lambda: fn(samples[0]), reward.key)
    verifier = VERIFIERS[default_verifier(cfg)]
    return lambda samples: _settled(lambda: verifier(samples[0], cfg), None)


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
            return await _settled(lambda: self._post(body), None, many=len(samples))

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


async def _settled(call: Callable[[], Any], key: str | None, many: int = 0) -> Reward | list[Reward]:
    """The call's reward(s) (it may return an awaitable); whatever it raises as Reward(s) with ``error`` set.

    ``many``: the call scores that many samples (a list comes back); 0: one sample.
    """
    try:
        raw = call()
        while inspect.isawaitable(raw):  # a sync wrapper may hand back the coroutine of an async __call__
            raw = await raw
        if many and raw and isinstance(raw[0], Reward):
            return raw
        if many:
            if not isinstance(raw, Sequence) or len(raw) != many:
                raise TypeError(f"returned {raw!r:.200}, not a list of {many} rewards")
            return [as_reward(value, key) for value in raw]
        return as_reward(raw, key)
    except Exception as exc:  # the user's code: whatever it raises is this sample's reward error
        return _errors(f"{type(exc).__name__}: {exc}"[:500], many)


def _errors(error: str, many: int) -> Reward | list[Reward]:
    failed = Reward(0.0, error=error)
    return [failed] * many if many else failed


def load_reward(cfg: Config) -> RewardModel:
    """The configured reward; an import path that does not resolve raises ValueError naming it (resolved
    here, at the start, though the reward processes import it again)."""
    reward = cfg.reward
    if reward.url:
        return RewardService(reward.url, reward.key, reward.timeout_s, reward.retries, reward.max_concurrency)
    for knob in ("fn", "group_fn"):
        if getattr(reward, knob):
            import_path(getattr(reward, knob), f"reward.{knob}")
    return PooledReward(cfg)
