"""Groups on buffer.groups as the stream processor emits them, without running it: the records on the rollout
topics, then each group's manifest, made by the processor's own assembler from where the records landed, and
the group settled in the ledger (sent, queued)."""
from __future__ import annotations

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.codec import encode, headers_for
from milestream.schemas.records import GroupManifest, LogProbs, Record, Trajectory
from milestream.streams.groups import GroupAssembler, oldest_version
from milestream.streams.ledger import EMITTED, BufferLedger
from milestream.streams.sources import SourceRef, refs_of

Published = tuple[topics.TopicSpec, Record]


def simple_group(group_id: str, version: int, size: int) -> list[Published]:
    """G one-token samples whose token came from weight ``version``."""
    return [(topics.TRAJECTORIES, Trajectory(f"{group_id}/{i}", group_id, "p", i, size, [1], [2], [1], [version],
                                             0.0, "completed", "", "e", "w", 0.0, 0.0)) for i in range(size)] + \
        [(topics.LOGPROBS, LogProbs(f"{group_id}/{i}", group_id, i, size, [-0.5])) for i in range(size)]


def publish(producer: RecordProducer, records: list[Published]) -> list[SourceRef]:
    """The records on their topics, one a value, keyed by group id; the refs of where each landed."""
    landed = {}
    for index, (spec, record) in enumerate(records):
        producer.send_raw(spec, encode([record]), record.group_id, headers_for(spec.record),
                          delivered=lambda where, index=index: landed.__setitem__(index, where))
    producer.flush()
    return [refs_of([record], spec.record, landed[i].partition, landed[i].offset, record.group_size)[0]
            for i, (spec, record) in enumerate(records)]


def emit(cfg: Config, producer: RecordProducer, records: list[Published]) -> dict[str, list[GroupManifest]]:
    """The complete groups of ``records`` emitted and settled; their manifests by group id, in completion order."""
    assembler, manifests = GroupAssembler(), {}
    for ref in publish(producer, records):
        outcome, _ = assembler.add(ref)
        if outcome is not None:
            manifests[outcome.group_id] = outcome.manifest
    ledger = BufferLedger(cfg)
    for group_id, manifest in manifests.items():
        producer.send(topics.GROUPS, manifest, key=group_id)
        ledger.begin_sending(group_id)
    producer.flush()
    for group_id, manifest in manifests.items():
        oldest = oldest_version(manifest)
        ledger.settle(group_id, EMITTED, -1 if oldest is None else oldest)
    return manifests
