"""Restart safety without broker transactions: SIGKILL the processor while groups flow, restart it,
and every group that entered leaves exactly once (after de-duplication by group id), none lost.

Records of several groups are interleaved on each partition, as concurrent rollout workers write
them; every other group also carries MoE routing chunks on rollout.routing, which the join must
deliver intact. A kill wave is cut in two: its first part completes some groups and only half-fills the
others, the processor emits the complete ones and commits, and then it is killed before the second
part arrives. A commit that passed an offset of a half-filled group would lose that group's early
records on restart; a processor that forgot what it had emitted would emit or count a group twice.
"""
from __future__ import annotations

import collections
import random

import numpy as np
from synthetic import (ProcessorProcess, admit, all_partitions, expert_ids, group_records, topic_reader, wait_until,
                       with_credit)

from milestream.infra.kafka import LogAdmin, RecordProducer, topic_name
from milestream.log.reader import BrokerSource
from milestream.log.samples import logged_samples
from milestream.schemas import routing, topics
from milestream.streams.groups import source_topics
from milestream.streams.ledger import SETTLED, BufferLedger
from milestream.streams.processor import app_id

GROUP_SIZE = 4
WAVES = 10
GROUPS_PER_WAVE = 8  # the first half complete within the wave's first part, the rest straddle the cut
KILL_WAVES = (1, 3, 5, 7)
COMMIT_INTERVAL_S = 0.5
SOURCES = source_topics(teacher=False)


def split_wave(wave: int, rng: random.Random):
    """(first part, second part, groups complete in the first part, every group of the wave)."""
    ids = [f"w{wave}-g{i}#0" for i in range(GROUPS_PER_WAVE)]
    records = {gid: group_records(gid, GROUP_SIZE, with_routing=i % 2 == 1) for i, gid in enumerate(ids)}
    early, late = ids[:GROUPS_PER_WAVE // 2], ids[GROUPS_PER_WAVE // 2:]
    late_records = {gid: records[gid] for gid in late}
    first = [r for gid in early for r in records[gid]]
    first += [r for gid in late for r in late_records[gid][::2]]
    second = [r for gid in late for r in late_records[gid][1::2]]
    rng.shuffle(first)
    rng.shuffle(second)
    return first, second, early, ids


def read_topic(cfg, spec) -> list:
    reader = topic_reader(cfg, spec)
    try:
        return [r for d in reader.drain(idle_s=2.0) for r in d.records]
    finally:
        reader.close()


def committed(cfg) -> dict[tuple[str, int], int]:
    """The processor group's committed offset of every source partition (0 where none yet)."""
    offsets = LogAdmin(cfg.broker).committed(app_id(cfg))  # an offset fetch only: it never joins the group
    wanted = [(topic_name(cfg.broker, s), p) for s in SOURCES for p in all_partitions(cfg, s)]
    return {position: offsets.get(position, 0) for position in wanted}


def log_ends(cfg) -> dict[tuple[str, int], int]:
    """One past the last offset of every source partition, from reading it (tansu's end offsets are wrong)."""
    ends = {(topic_name(cfg.broker, s), p): 0 for s in SOURCES for p in all_partitions(cfg, s)}
    for spec in SOURCES:
        reader = topic_reader(cfg, spec)
        for delivery in reader.drain(idle_s=2.0):
            position = delivery.position
            ends[position.topic, position.partition] = max(ends[position.topic, position.partition], position.offset + 1)
        reader.close()
    return ends


def publish(producer: RecordProducer, records) -> None:
    for spec, record in records:
        producer.send(spec, [record], key=record.group_id)
    producer.flush()


class EmittedGroups:
    """Every manifest on buffer.groups, counted by group id (duplicates included)."""

    def __init__(self, cfg):
        self.reader = topic_reader(cfg, topics.GROUPS)
        self.messages: collections.Counter[str] = collections.Counter()
        self.sizes: dict[str, set[int]] = collections.defaultdict(set)

    def catch_up(self, idle_s: float = 0.2) -> None:
        for delivery in self.reader.drain(idle_s=idle_s, max_wait_s=30.0):
            gid = delivery.records[0].group_id
            self.messages[gid] += 1
            self.sizes[gid].add(len(delivery.records))

    def wait_for(self, group_ids, processor, timeout_s: float) -> None:
        def arrived() -> bool:
            processor.assert_alive()
            self.catch_up()
            return not set(group_ids) - self.messages.keys()
        wait_until(arrived, timeout_s, f"groups {sorted(set(group_ids) - self.messages.keys())[:8]} on buffer.groups")


def drive_waves(cfg, processor: ProcessorProcess, emitted: EmittedGroups) -> list[str]:
    producer = RecordProducer(cfg.broker, client_id="restart-test")
    rng = random.Random(7)
    entered: list[str] = []
    ledger = BufferLedger(cfg)
    committed_at_kill = sum(committed(cfg).values())
    for wave in range(WAVES):
        first, second, early, ids = split_wave(wave, rng)
        admit(cfg, ids)
        publish(producer, first)
        if wave in KILL_WAVES:
            emitted.wait_for(early, processor, timeout_s=120)
            # settled (delivered, accounted) while the half-filled groups are held: the next life
            # re-reads records of groups that are already gone
            wait_until(lambda: all(ledger.settlement(g) == SETTLED for g in early), 60, "the complete groups settled")
            # commits happen while the processor runs, not only when it stops cleanly: everything
            # before this wave has left since the last kill, so the committed position moved on
            before = committed_at_kill
            wait_until(lambda: sum(committed(cfg).values()) > before, 60, "a commit since the last kill")
            committed_at_kill = sum(committed(cfg).values())
            processor.kill()
            processor.start()
        publish(producer, second)
        entered += ids  # every trajectory and log-prob of these groups is now on the log
    return entered


def test_sigkill_at_several_points_loses_no_group_and_counts_each_once(cfg, tmp_path):
    cfg = with_credit(cfg, WAVES * GROUPS_PER_WAVE).with_overrides(buffer={"commit_interval_s": COMMIT_INTERVAL_S})
    processor = ProcessorProcess(cfg, tmp_path)
    processor.start()
    emitted = EmittedGroups(cfg)
    try:
        entered = drive_waves(cfg, processor, emitted)
        emitted.wait_for(entered, processor, timeout_s=240)
        ledger = BufferLedger(cfg)  # settled once delivered: a moment after the group is readable
        wait_until(lambda: ledger.run_totals().get("groups_out", 0) >= len(entered), 60,
                   "the processor's run totals to count every group")
        emitted.catch_up(idle_s=2.0)  # late re-emissions from the last restart, if any
        totals = ledger.run_totals()
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        processor.stop()
    dropped = [r.group_id for r in read_topic(cfg, topics.DROPPED)]
    processor_metrics = [m.values for m in read_topic(cfg, topics.METRICS) if m.source == "processor"]
    # once every group has left, a clean stop commits every source partition to its end
    assert committed(cfg) == log_ends(cfg)
    emitted.reader.close()

    assert processor.lives == len(KILL_WAVES) + 1
    # the kills came while groups were held: restarted lives re-read records of groups already gone
    assert any(values.get("groups_settled_before_restart", 0) > 0 for values in processor_metrics)
    # none lost, nothing extra, and each group left exactly once: emitted, never also dropped
    assert set(emitted.messages) == set(entered)
    assert dropped == []
    assert all(sizes == {GROUP_SIZE} for sizes in emitted.sizes.values())
    # each manifest points at its group's records: joined, every sample whole and the routing exact
    samples = logged_samples(BrokerSource(cfg, idle_s=1.0))
    assert samples.keys() == set(entered)
    routed = {gid for gid in entered if int(gid.split("-g")[1].split("#")[0]) % 2 == 1}
    intact = {gid: [np.array_equal(ids, expert_ids(gid, s.sample_index, len(s.response_ids)))
                    for s in group if (ids := routing.expert_ids(s)) is not None] for gid, group in samples.items()}
    assert {gid for gid, checks in intact.items() if checks} == routed
    assert all(all(checks) and len(checks) in (0, GROUP_SIZE) for checks in intact.values())
    # the processor's accounting counted each group once, however many times it reached the topic
    duplicates = sum(count - 1 for count in emitted.messages.values())
    print(f"{len(entered)} groups, {duplicates} duplicate emissions, processor totals {totals}")
    assert totals["groups_out"] == len(entered)
    assert ledger.queued() == len(entered)
    assert duplicates <= totals.get("groups_resent", 0)
