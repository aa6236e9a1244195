"""Taking groups out of the buffer for a training step: the trainer's side of the buffer.

Groups read from ``buffer.groups`` wait in a local pool; a data selector (an import path) picks
each batch from the pool. At collection a group past the staleness window (``cfg.staleness_bound``: 0 in
the sync schedule, 1 in one_step) is dropped onto ``buffer.dropped`` (Miles' third drop rule). A group
leaves the buffer — its credit returns — when it is taken or dropped; in the sync and one_step schedules
the version floor is raised first, so the credit of a batch admits only prompts a new enough engine takes.
The offsets to checkpoint stop below the oldest group still in the pool, so a resumed trainer re-reads
what it had not used, and skips by id what it had.

A value on ``buffer.groups`` the processor did not send (its group id never settled), or that no training
step could take (a sample that breaks the processor's rules, a group not whole, a token id outside the
vocabulary, routing that does not unpack), is dead-lettered; one the processor did send is dropped as well
(reason ``invalid``), so its credit comes back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import zstandard

from milestream.config import Config, import_path
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.model import model_config
from milestream.infra.offsets import HeldOffsets
from milestream.schemas import routing, topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import GroupSample
from milestream.streams.groups import MismatchError, check_record, drop_record, oldest_version, staleness
from milestream.streams.ledger import BufferLedger


@dataclass(frozen=True)
class PooledGroup:
    group_id: str
    samples: list[GroupSample]
    position: Position
    arrival: int  # order of arrival in this trainer process

    @property
    def oldest_version(self) -> int:
        oldest = oldest_version(self.samples)
        return -1 if oldest is None else oldest


Selector = Callable[[Sequence[PooledGroup], int], list[PooledGroup]]


def fifo(pool: Sequence[PooledGroup], count: int) -> list[PooledGroup]:
    """The groups that arrived first (the default)."""
    return sorted(pool, key=lambda g: g.arrival)[:count]


def freshest_first(pool: Sequence[PooledGroup], count: int) -> list[PooledGroup]:
    """The groups whose oldest token is newest: less off-policy data, older groups wait (and may go stale)."""
    return sorted(pool, key=lambda g: (-g.oldest_version, g.arrival))[:count]


class GroupCollector:
    def __init__(self, cfg: Config, producer: RecordProducer, offsets: dict[int, int], partitions: list[int],
                 seen_groups: set[str], resumed: bool = False):
        self.cfg, self.producer, self.seen_groups = cfg, producer, seen_groups
        self.selector: Selector = import_path(cfg.buffer.selector, "buffer.selector")
        self.ledger = BufferLedger(cfg)
        text_config = model_config(cfg.model).get_text_config()
        self.vocab_size, self.context = text_config.vocab_size, text_config.max_position_embeddings
        self.consumer = RecordConsumer(cfg.broker, topics.GROUPS, f"{cfg.broker.topic_prefix}trainer",
                                       deadletter=producer, check=self._check).assign(offsets, partitions)
        self.held = HeldOffsets(resumed=offsets)
        self.pool: dict[str, PooledGroup] = {}
        self.arrivals = 0
        self.dropped_stale = 0
        self.collected_lags: list[int] = []  # of every group taken or dropped stale since the last step's figures
        # by reason, up to the last step's figures: a fresh run counts from its start, a resumed one from now
        self.drops_counted = self._drop_totals() if resumed else {}

    def take(self, count: int, version: int, stopping: Callable[[], bool]) -> list[tuple[PooledGroup, int]] | None:
        """``count`` fresh groups chosen by the selector, each with its staleness; None once stopping."""
        while not stopping():
            self._read(timeout=0.05 if len(self.pool) >= count else 1.0)
            self._drop_stale(version)
            if len(self.pool) >= count:
                chosen = self.selector(list(self.pool.values()), count)
                if self.cfg.admission_lead is not None:
                    self.ledger.raise_floor(version + self.cfg.admission_lead)
                for group in chosen:
                    self._leave(group)
                taken = [(g, staleness(g.samples, version)) for g in chosen]
                self.collected_lags += [lag for _, lag in taken]
                return taken
        return None

    def take_pool_figures(self, version: int) -> dict[str, float]:
        """Groups read but not yet taken, their staleness at ``version``, the stale drops so far, and the
        staleness of every group collected (trained or dropped stale) since the last call."""
        lags = [staleness(g.samples, version) for g in self.pool.values()]
        collected, self.collected_lags = self.collected_lags, []
        return {"pool_groups": float(len(lags)), "pool_staleness_mean": sum(lags) / len(lags) if lags else 0.0,
                "pool_staleness_max": float(max(lags, default=0)), "stale_dropped_total": float(self.dropped_stale),
                "collected_staleness_mean": sum(collected) / len(collected) if collected else 0.0,
                "collected_staleness_max": float(max(collected, default=0))}

    def take_drop_figures(self) -> dict[str, float]:
        """``dropped_<reason>``: the groups dropped since the last call, by the processor (its run totals in
        the ledger) and here (stale)."""
        totals = self._drop_totals()
        since = {reason: count - self.drops_counted.get(reason, 0) for reason, count in totals.items()}
        self.drops_counted = totals
        return {f"dropped_{reason}": float(count) for reason, count in sorted(since.items())}

    def _drop_totals(self) -> dict[str, int]:
        totals = {key.removeprefix("dropped_"): count for key, count in self.ledger.run_totals().items()
                  if key.startswith("dropped_")}
        return {**totals, "stale": totals.get("stale", 0) + self.dropped_stale}

    def offsets(self) -> dict[int, int]:
        """Next offsets to read on resume: below the oldest group still pooled."""
        return self.held.committable()

    def _read(self, timeout: float) -> None:
        while (delivery := self.consumer.poll(timeout)) is not None:
            timeout = 0.0  # take what is already there, then go on
            position = delivery.position
            self.held.started(position.partition, position.offset)
            group_id = delivery.records[0].group_id
            if group_id in self.seen_groups or group_id in self.pool:
                self.held.done(position.partition, position.offset)  # re-emitted after a processor restart
                continue
            self.pool[group_id] = PooledGroup(group_id, delivery.records, position, self.arrivals)
            self.arrivals += 1

    def _check(self, samples: list[GroupSample], position: Position) -> None:
        """Raise RecordError (the consumer dead-letters the value) for a group this trainer cannot take; one
        the processor sent is dropped too, so its credit comes back."""
        group_id = samples[0].group_id
        if group_id in self.seen_groups:
            return  # taken or dropped before: skipped as a re-read
        sent = self.ledger.settlement(group_id) is not None
        try:
            check_group(samples, self.cfg.rollout.group_size, self.vocab_size, self.context, self.cfg.distill.enabled)
        except MismatchError as exc:
            if sent:
                record = drop_record(group_id, samples, "invalid", f"{exc.field}: {exc}", "trainer", -1)
                self.producer.send(topics.DROPPED, [record], key=group_id)
                self.seen_groups.add(group_id)
                self.ledger.leave(group_id)
            raise RecordError(position, exc.field, str(exc)) from None
        if not sent:
            raise RecordError(position, "group_id", f"the processor never sent group {group_id!r}")

    def _drop_stale(self, version: int) -> None:
        for group in list(self.pool.values()):
            lag = staleness(group.samples, version)
            if lag > self.cfg.staleness_bound:
                detail = f"staleness {lag} > {self.cfg.staleness_bound} ({self.cfg.run.schedule} schedule)"
                record = drop_record(group.group_id, group.samples, "stale", detail, "trainer", version)
                self.producer.send(topics.DROPPED, [record], key=group.group_id)
                self.dropped_stale += 1
                self.collected_lags.append(lag)
                self._leave(group)

    def _leave(self, group: PooledGroup) -> None:
        del self.pool[group.group_id]
        self.seen_groups.add(group.group_id)
        self.held.done(group.position.partition, group.position.offset)
        self.ledger.leave(group.group_id)

    def close(self) -> None:
        self.consumer.close()


def check_group(samples: list[GroupSample], group_size: int, vocab_size: int, context: int,
                needs_teacher: bool = False) -> None:
    """Raise MismatchError naming the field of a group no training step can take (``context``: the model's;
    ``needs_teacher``: on-policy distillation is on)."""
    for sample in samples:
        check_record(sample, group_size)
        if needs_teacher and len(sample.teacher_logprobs) != len(sample.response_ids):
            raise MismatchError("teacher_logprobs", f"sample {sample.sample_index}: no teacher log-probs, and "
                                "distill is on")
        if sample.group_id != samples[0].group_id:
            raise MismatchError("group_id", f"samples of groups {samples[0].group_id!r} and {sample.group_id!r}")
        if max(sample.prompt_ids + sample.response_ids, default=0) >= vocab_size:
            raise MismatchError("response_ids", f"a token id past the vocabulary ({vocab_size})")
        if len(sample.prompt_ids) + len(sample.response_ids) > context:
            raise MismatchError("response_ids", f"{len(sample.prompt_ids) + len(sample.response_ids)} tokens, past "
                                f"the model's context of {context}")
        if sample.routing_layout or sample.routing_data:
            _check_routing(sample)
    indices = sorted(s.sample_index for s in samples)
    if indices != list(range(group_size)):
        raise MismatchError("sample_index", f"samples {indices} of a group of {group_size}")


def _check_routing(sample: GroupSample) -> None:
    """The routing unpacks to its layout; a chunk claiming more bytes than the layout holds is refused unread."""
    layout = sample.routing_layout
    whole = layout[0] * layout[1] * layout[2] * layout[3] if len(layout) == 4 and min(layout) >= 0 else -1
    try:
        if whole < 0 or sum(zstandard.frame_content_size(chunk) for chunk in sample.routing_data) > whole:
            raise ValueError(f"layout {layout} for {len(sample.routing_data)} chunks")
        routing.expert_ids(sample)
    except (ValueError, zstandard.ZstdError) as exc:
        raise MismatchError("routing_data", f"sample {sample.sample_index}: {exc}") from None
