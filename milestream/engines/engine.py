"""The rollout engine contract, and a continuous-batching CPU engine on transformers.

An engine turns token prompts into sampled completions with the behaviour log-prob and the
weight version of every token, and accepts weight updates while requests are in flight: an
update lands between two decode steps, and the rows already running are aborted, kept in place
(their KV cache stays) or retracted and resumed on the new weights (``inflight``); kept or
resumed, a completion spans several versions (the trainer corrects for it with importance weights).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedTokenizerBase
from transformers.cache_utils import get_layer_types_and_kwargs

from milestream.config import ModelConfig, RolloutConfig
from milestream.infra import faults, on_policy
from milestream.infra.model import compute_dtype, load_model, load_trainable_state_dict, stop_token_ids
from milestream.engines.moe_routing import RecordedRouting, RoutingTap, RowRouting
from milestream.engines.scoring import ScoreRequest, full_kv_cache, left_padded, score_batch

FinishReason = Literal["stop", "length", "abort"]
InflightPolicy = Literal["abort", "keep", "retract"]  # config.WeightsConfig.inflight
SERVED_LAYERS = ("full_attention", "sliding_attention")  # transformers' layer types the CPU engine batches


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0: greedy, and the recorded log-probs are those of the untempered logits
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError(f"invalid sampling params {self}")


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    output_ids: tuple[int, ...]  # includes the stop token when finish_reason is "stop"
    logprobs: tuple[float, ...]  # log_softmax(raw logits / temperature) of each sampled token
    versions: tuple[int, ...]  # weight version of the forward pass that produced each token
    finish_reason: FinishReason
    routing: RecordedRouting | None = None  # MoE models: expert ids of every token (engines/moe_routing.py)
    # rollout.logprobs_topk > 0: for each token the k likeliest ids and their log-probs, from the same
    # distribution as its log-prob (descending); () when not asked
    topk_ids: tuple[tuple[int, ...], ...] = ()
    topk_logprobs: tuple[tuple[float, ...], ...] = ()


class Engine(Protocol):
    @property
    def version(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, version: int, tensors: dict[str, Tensor]) -> None: ...


def unserved(config: PretrainedConfig) -> str | None:
    """What keeps the CPU engine from serving a model of this configuration, or None. Its batches left-pad
    rows of different lengths and cut and join their KV caches, which layers of full or sliding-window
    attention take (a row's keys are one run, the mask places the window); chunked attention (chunks
    counted from the padded start) and layers of recurrent state (linear attention, convolutions) do not."""
    other = sorted(set(get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]) - set(SERVED_LAYERS))
    if not other:
        return None
    return (f"has {', '.join(other)} layers, which the CPU engine does not batch (it serves "
            f"{' and '.join(SERVED_LAYERS)} layers); serve the model behind rollout.engine_url")


def sampling_params(rollout_cfg: RolloutConfig, tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """The configured sampling, stopping at the end of the assistant turn (the token the chat template
    ends one with, which need not be the eos) or at the eos."""
    return SamplingParams(
        max_new_tokens=rollout_cfg.max_new_tokens,
        temperature=rollout_cfg.temperature,
        stop_token_ids=stop_token_ids(tokenizer),
    )


@dataclass(eq=False)
class _Row:
    """One request in flight; only the worker thread touches the lists."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: RowRouting | None = None
    topk_ids: list[tuple[int, ...]] = field(default_factory=list)
    topk_logprobs: list[tuple[float, ...]] = field(default_factory=list)

    def context(self) -> tuple[int, ...]:
        """What a prefill of this row runs over: the prompt, and any tokens it already generated
        (a row retracted by a weight update resumes from there)."""
        return self.request.input_ids + tuple(self.output_ids)

    def resolve(self, finish_reason: FinishReason) -> None:
        result = GenerateResult(
            self.request.request_id,
            tuple(self.output_ids),
            tuple(self.logprobs),
            tuple(self.versions),
            finish_reason,
            self.routing.result() if self.routing else None,
            tuple(self.topk_ids),
            tuple(self.topk_logprobs),
        )
        self._deliver(_set_result, result)

    def fail(self, exc: BaseException) -> None:
        self._deliver(_set_exception, exc)

    def _deliver(self, setter, value) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's event loop has closed: no one waits for the row
            self.loop.call_soon_threadsafe(setter, self.future, value)


def _set_result(future: asyncio.Future[GenerateResult], result: GenerateResult) -> None:
    if not future.done():  # the caller may have cancelled meanwhile
        future.set_result(result)


def _set_exception(future: asyncio.Future[GenerateResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


@dataclass
class _Batch:
    """Rows decoding together. Each row's tokens sit right-aligned in the KV cache: left padding
    (mask 0) fills the gap when rows of different lengths join, so one decode step appends one
    column for everyone."""

    rows: list[_Row]
    cache: DynamicCache  # full_kv_cache: every layer keeps all its keys, edited in place here
    mask: Tensor  # [B, L] 1 where the cache holds a real token
    last: Tensor  # [B] the token each row feeds next
    pos: Tensor  # [B] its position id (real tokens before it)


class CpuEngine:
    """Continuous batching on a background thread; asyncio callers only enqueue and await.

    Torch releases the GIL inside its kernels, so the caller's event loop stays responsive while
    the worker thread computes. Rows join the running batch between decode steps and leave it
    (their future resolved) as soon as they finish.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        *,
        seed: int = 0,  # sampling RNG; engines working side by side need distinct seeds
        initial_version: int = 0,
        admit_window_s: float = 0.005,  # lets a burst of concurrent generate() calls share one prefill
        inflight: InflightPolicy = "retract",  # what rows decoding when a weight update lands become
    ) -> None:
        # true on-policy: the trainer's numerics (infra/on_policy.py), its fp32 weights under its autocast
        self._exact = rollout_cfg.true_on_policy
        self._compute_dtype = compute_dtype(model_cfg)
        self.model: nn.Module = load_model(model_cfg, dtype=torch.float32 if self._exact else self._compute_dtype)
        self.model.requires_grad_(False)
        if reason := unserved(self.model.config):
            raise ValueError(f"{type(self.model).__name__} {reason}")
        if self._exact:
            on_policy.make_exact(self.model, rollout_cfg.max_context_tokens)
            on_policy.cast_linear_weights(self.model, self._compute_dtype)
        self._routing_tap = RoutingTap.attach(self.model)  # None: a dense model, nothing to record
        self._max_batch = rollout_cfg.max_batch
        self._topk = rollout_cfg.logprobs_topk
        self._admit_window_s = admit_window_s
        self._generator = torch.Generator().manual_seed(seed)
        self._version = initial_version
        self._inflight = inflight
        self.update_pause_s = 0.0  # how long the last weight update held generation still
        self.busy_s = 0.0  # time spent in prefill and decode steps (the generation utilisation's numerator)
        self._pending: deque[_Row] = deque()
        self._cond = threading.Condition()  # guards _pending, _paused, _closed, _stepping
        self._step_lock = threading.Lock()  # a step and a weight update never overlap
        self._paused = False
        self._closed = False
        self._stepping = False
        self._batch: _Batch | None = None
        self._thread = threading.Thread(target=self._run, name="milestream-cpu-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        row = _Row(request, loop.create_future(), loop)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._pending.append(row)
            self._cond.notify_all()
        return await row.future

    async def pause(self) -> None:
        """Returns once no step is running; none starts until ``resume``."""
        await asyncio.to_thread(self._pause_and_wait)

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def update_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's {self._version}")
        await asyncio.to_thread(self._apply_weights, version, tensors)

    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """The log-prob of every response token of ``requests`` (engines/scoring.py), between two steps."""
        return await asyncio.to_thread(self._score, list(requests))

    def _score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        with self._step_lock, torch.inference_mode():
            return score_batch(self._forward, requests)

    async def close(self) -> None:
        """Stops the worker; requests still in flight resolve with finish_reason "abort"."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)

    def _pause_and_wait(self) -> None:
        with self._cond:
            self._paused = True
            while self._stepping:
                self._cond.wait()

    def _apply_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        # A lock of its own rather than _cond: copying a full model takes long enough that the
        # event loop must not block on it in generate().
        with self._step_lock:
            started = time.perf_counter()
            self._settle_inflight()
            load_trainable_state_dict(self.model, tensors)
            if self._exact:
                params = dict(self.model.named_parameters())
                on_policy.recast_tied(self.model, self._compute_dtype, [params[name] for name in tensors])
            self._version = version
            self.update_pause_s = time.perf_counter() - started

    def _settle_inflight(self) -> None:
        """The rows decoding when a version lands, by policy (between two steps, under the step lock).

        keep     they go on in place: their KV cache stays the old weights', later tokens are new
        abort    they finish at once with finish_reason "abort" (the group is dropped as aborted)
        retract  they leave the batch with the tokens they have and go back to the front of the
                 queue; the next step prefills prompt + those tokens with the new weights and they
                 resume. Every token keeps the version that produced it.

        Under true on-policy keep retracts: a token decoded over the old weights' keys is what no
        forward of the new weights computes, so the trainer could never match it.
        """
        batch = self._batch
        policy = "retract" if self._exact and self._inflight == "keep" else self._inflight
        if batch is None or policy == "keep":
            return
        self._batch = None
        if policy == "abort":
            for row in batch.rows:
                row.resolve("abort")
            return
        with self._cond:
            self._pending.extendleft(reversed(batch.rows))

    def _run(self) -> None:
        while (admitted := self._next_admission()) is not None:
            started = time.perf_counter()
            try:
                with self._step_lock, torch.inference_mode():
                    self._step(admitted)
            except Exception as exc:  # noqa: BLE001 - the callers must hear of it, and the engine lives on
                for row in admitted + (self._batch.rows if self._batch else []):
                    row.fail(exc)
                self._batch = None
            finally:
                self.busy_s += time.perf_counter() - started
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()
            faults.hold("engine.stepped")
        with self._cond:
            rows = list(self._pending) + (self._batch.rows if self._batch else [])
            self._pending.clear()
        for row in rows:
            row.resolve("abort")
        self._batch = None

    def _next_admission(self) -> list[_Row] | None:
        """Waits for work; returns the rows to admit in the next step, or None on close.

        The step counts as started (``_stepping``) under the same lock that checked ``_paused``,
        so a ``pause`` can never slip in between the check and the step.
        """
        if self._batch is None and self._admit_window_s > 0:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._pending))
            time.sleep(self._admit_window_s)
        with self._cond:
            self._cond.wait_for(lambda: self._closed or not (self._paused or self._idle()))
            if self._closed:
                return None
            self._stepping = True
            room = self._max_batch - (len(self._batch.rows) if self._batch else 0)
            return [self._pending.popleft() for _ in range(min(room, len(self._pending)))]

    def _idle(self) -> bool:
        return self._batch is None and not self._pending

    def _step(self, admitted: list[_Row]) -> None:
        faults.fail("engine.step")
        batch = self._batch
        if batch is not None:
            self._keep(batch, [not row.future.cancelled() for row in batch.rows])
            if batch.rows:
                self._decode(batch)
            if not batch.rows:
                batch = None
        admitted = [row for row in admitted if not row.future.cancelled()]
        if admitted:
            joined = self._prefill(admitted)
            if joined.rows:
                batch = joined if batch is None else _merge(batch, joined)
        self._batch = batch

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Runs each distinct prompt once, then copies its KV cache to every row that shares it."""
        prompts: dict[tuple[int, ...], int] = {}
        for row in rows:
            prompts.setdefault(row.context(), len(prompts))
        ids, mask = left_padded(list(prompts))
        width = ids.shape[1]
        cache = full_kv_cache()
        logits = self._forward(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        index = torch.tensor([prompts[row.context()] for row in rows])
        if self._routing_tap:
            self._routing_tap.after_prefill(rows, index.tolist(), len(prompts), width)
        cache.batch_select_indices(index)
        pos = mask.sum(-1)[index]
        batch = _Batch(rows, cache, mask[index], torch.zeros(len(rows), dtype=torch.long), pos)
        self._sample_and_finish(batch, logits[index])
        return batch

    def _decode(self, batch: _Batch) -> None:
        batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        logits = self._forward(
            input_ids=batch.last[:, None],
            attention_mask=batch.mask,
            position_ids=batch.pos[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        ).logits[:, -1]
        if self._routing_tap:
            self._routing_tap.after_decode(batch.rows)
        batch.pos = batch.pos + 1
        self._sample_and_finish(batch, logits)

    def _forward(self, **inputs) -> Tensor:
        """The model's output; under true on-policy in the trainer's compute context."""
        if not self._exact:
            return self.model(**inputs)
        with on_policy.autocast(self._compute_dtype):
            return self.model(**inputs)

    def _sample_and_finish(self, batch: _Batch, logits: Tensor) -> None:
        """Samples one token per row, records it, and resolves and drops the rows that are done."""
        tokens, logp = self._sample(logits, [row.request.sampling.temperature for row in batch.rows])
        batch.last = tokens
        logprobs = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        if self._topk:
            top = logp.topk(min(self._topk, logp.shape[-1]), dim=-1)
            for row, ids, values in zip(batch.rows, top.indices.tolist(), top.values.tolist()):
                row.topk_ids.append(tuple(ids))
                row.topk_logprobs.append(tuple(values))
        keep = []
        for row, token, logprob in zip(batch.rows, tokens.tolist(), logprobs):
            row.output_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(self._version)
            sampling = row.request.sampling
            reason: FinishReason | None = None
            if token in sampling.stop_token_ids:
                reason = "stop"
            elif len(row.output_ids) >= sampling.max_new_tokens:
                reason = "length"
            if reason is not None:
                row.resolve(reason)  # at once: the caller should not wait for the rest of the batch
            keep.append(reason is None)
        self._keep(batch, keep)

    def _sample(self, logits: Tensor, temperatures: list[float]) -> tuple[Tensor, Tensor]:
        """One token per row, and the log-probs [B, V] it was drawn from."""
        temps = torch.tensor(temperatures, dtype=torch.float32)[:, None]
        logp = torch.log_softmax(on_policy.scaled_logits(logits, temps), dim=-1)  # as the trainer computes it
        tokens = torch.where(temps == 0, logits.argmax(-1, keepdim=True), self._inverse_cdf(logp))
        return tokens[:, 0], logp

    def _inverse_cdf(self, logp: Tensor) -> Tensor:
        """One uniform per row against the float64 CDF.

        torch.multinomial (and Gumbel/exponential tricks) draw a random number per vocabulary
        entry: ~50 ms for 32 rows x 49k tokens, as much as a SmolLM2 decode step; this is ~5x
        cheaper. float64 keeps the CDF steps of rare tokens exact enough to match the recorded
        log-probs.
        """
        cdf = torch.cumsum(logp.exp(), dim=-1, dtype=torch.float64)
        u = torch.rand(logp.shape[0], 1, dtype=torch.float64, generator=self._generator) * cdf[:, -1:]
        # u < total, so an index always exists; the clamp only guards the product's last-bit rounding.
        return torch.searchsorted(cdf, u, right=True).clamp_(max=logp.shape[-1] - 1)

    @staticmethod
    def _keep(batch: _Batch, keep: list[bool]) -> None:
        """Drops the rows not kept, then the leading columns that are now padding for everyone."""
        if all(keep):
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long)
        batch.rows = [row for row, k in zip(batch.rows, keep) if k]
        batch.cache.batch_select_indices(index)
        batch.mask, batch.last, batch.pos = batch.mask[index], batch.last[index], batch.pos[index]
        if batch.rows:
            start = int(batch.mask.any(0).long().argmax())
            if start > 0:
                batch.mask = batch.mask[:, start:]
                for layer in batch.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch holding the rows of both, the shorter side left-padded to a common length."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    for layer_a, layer_b in zip(a.cache.layers, b.cache.layers):
        layer_a.keys = torch.cat([_left_pad(layer_a.keys, width), _left_pad(layer_b.keys, width)])
        layer_a.values = torch.cat([_left_pad(layer_a.values, width), _left_pad(layer_b.values, width)])
    mask = torch.cat([_left_pad(a.mask, width), _left_pad(b.mask, width)])
    return _Batch(a.rows + b.rows, a.cache, mask, torch.cat([a.last, b.last]), torch.cat([a.pos, b.pos]))


def _left_pad(tensor: Tensor, width: int) -> Tensor:
    """Zero-pads dimension 1 of a mask ``[B, L]`` or dimension 2 of a cache tensor ``[B, H, L, D]``."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
