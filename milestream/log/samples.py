"""The samples of emitted groups, from the log alone: each manifest on ``buffer.groups`` joined with the
rollout records it points at, as the trainer joined them (streams/groups.py ``join_sample``).

Records come back at their archived offsets (log/restore.py), so a manifest's positions hold in the archive
as on the broker. A group emitted more than once (a processor restart re-sends it) is the same group: the
first manifest counts.
"""
from __future__ import annotations

from milestream.log.reader import LogSource
from milestream.schemas import topics
from milestream.schemas.records import GroupManifest, GroupSample, Record
from milestream.streams.groups import join_sample, record_positions


def logged_manifests(source: LogSource) -> dict[str, list[GroupManifest]]:
    """Each emitted group's first manifest, by group id."""
    out: dict[str, list[GroupManifest]] = {}
    for message in source.messages(topics.GROUPS):
        if message.records:
            out.setdefault(message.records[0].group_id, message.records)
    return out


def logged_samples(source: LogSource, wanted: set[str] | None = None) -> dict[str, list[GroupSample]]:
    """The samples of the emitted groups (``wanted`` ones only, when given), by group id."""
    manifests = {g: rows for g, rows in logged_manifests(source).items() if wanted is None or g in wanted}
    if not manifests:
        return {}
    # only the topics the manifests point at: no routing read for a dense model, no teacher's without distill
    pointed = {spec for rows in manifests.values() for row in rows for spec, *_ in record_positions(row)}
    source.prefetch(pointed)
    records: dict[tuple[str, int, int], list[Record]] = {
        (spec.name, m.partition, m.offset): m.records for spec in pointed for m in source.messages(spec)}

    def joined(row: GroupManifest) -> GroupSample:
        return join_sample(row, [records[(spec.name, row.partition, offset)][index]
                                 for spec, offset, index, _ in record_positions(row)])

    return {group_id: [joined(row) for row in rows] for group_id, rows in manifests.items()}
