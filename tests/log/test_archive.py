"""The durable log on one machine: archive every topic to Parquet, republish it into a fresh broker
byte for byte at the same offsets, and resume a run whose in-memory broker was restarted."""
from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

from milestream.log.archive import Archiver, ArchiveState, archive_dir, read_topic
from milestream.log.audit import archived_lineage
from milestream.log.lineage import Lineage
from milestream.log.reader import read_archive
from milestream.log.restore import republish
from milestream.infra.kafka import (LogAdmin, RawConsumer, RawMessage, RecordConsumer, RecordProducer, commit_offsets,
                                    produce_raw, topic_name)
from milestream.infra.services import EmbeddedBroker
from milestream.observe.feed import TopicFeed
from milestream.schemas import topics
from milestream.schemas.records import Metrics, Prompt
from milestream.streams.ledger import BufferLedger

from holds import Holds

HELD_AT_SAMPLE = 30  # the rollout worker holds after this many samples: no multiple of the group size
RawRecord = tuple[bytes | None, bytes | None, tuple, tuple[int, int]]


def raw_dump(cfg, idle_s: float = 3.0) -> dict[tuple[str, int, int], RawRecord]:
    """Every record of the run's topics on the broker: (topic, partition, offset) -> key, value, headers, ts."""
    names = {topic_name(cfg.broker, spec): spec.name for spec in topics.CATALOGUE}
    partitions = LogAdmin(cfg.broker).list_topics()
    consumer = RawConsumer(cfg.broker, f"dump-{time.time()}").assign(
        {(full, p): None for full in names for p in range(partitions[full])})
    out = {}
    try:
        while batch := consumer.consume(idle_s):
            for msg in batch:
                key = (names[msg.topic], msg.partition, msg.offset)
                out[key] = (msg.key, msg.value, tuple(msg.headers or ()), (msg.timestamp_type, msg.timestamp_ms))
    finally:
        consumer.close()
    return out


def produce_mixed(cfg, start: int, count: int) -> None:
    """Typed records on keyed and single-partition topics, and raw oddities the archive must keep."""
    records = RecordProducer(cfg.broker, client_id="archive-test")
    for i in range(start, start + count):
        prompt = Prompt(f"p-{i}", "chain_sum", i, f"{i} + 1 = ?", str(i + 1), "{}")
        records.send(topics.PROMPTS, [prompt], key=prompt.prompt_id)
        records.send(topics.METRICS, [Metrics("test", i, float(i), {"x": float(i)})], key="test")
    full = topic_name(cfg.broker, topics.DEADLETTER)  # any bytes are legal on the wire; the archive does not decode
    oddities = [  # (partition, timestamp (0: the broker's), key, headers, value)
        (1, 1_000 + start, b"tombstone", None, None),
        (2, 0, None, [("a", b"1"), ("a", None), ("ms-schema", b"Bogus/9")], b"\x00\xffnot arrow"),
        (0, 0, b"big", None, bytes(range(256)) * 8192),  # 2 MiB
    ]
    failures = []
    for partition, timestamp_ms, key, headers, value in oddities:
        produce_raw(records, full, RawMessage(full, partition, -1, timestamp_ms, 0, key, headers, value),
                    lambda err, _offset: failures.append(err) if err is not None else None)
    records.flush()
    assert not failures


def archive_until_idle(cfg, **options) -> Archiver:
    archiver = Archiver(cfg, **options)
    stop = threading.Event()
    stop.set()  # no live phase: just drain what is there (until idle) and flush
    archiver.run(stop)
    return archiver


def test_archive_republish_is_byte_exact(cfg, tmp_path):
    options = {"segment_records": 7, "flush_s": 0.2, "idle_s": 3.0}
    produce_mixed(cfg, 0, 20)
    archive_until_idle(cfg, **options)
    after_first = (archive_dir(cfg.run.run_dir) / "state.json").read_bytes()

    # a later life archives more; then its state writes are "lost" (a crash after its segments were
    # renamed): the next life must move past those segments, not archive their records again
    produce_mixed(cfg, 20, 15)
    archive_until_idle(cfg, **options)
    (archive_dir(cfg.run.run_dir) / "state.json").write_bytes(after_first)
    produce_mixed(cfg, 35, 5)
    commit_offsets(cfg.broker, f"{cfg.broker.topic_prefix}rollout", {(topic_name(cfg.broker, topics.PROMPTS), 1): 3})
    archive_until_idle(cfg, **options)

    source = raw_dump(cfg)
    for spec in topics.CATALOGUE:  # each record archived exactly once, offsets dense from 0
        table = read_topic(cfg.run.run_dir, spec.name, ["partition", "offset"])
        pairs = list(zip(table["partition"].to_pylist(), table["offset"].to_pylist()))
        assert len(pairs) == len(set(pairs)) == sum(1 for t, *_ in source if t == spec.name)
    assert ArchiveState.load(cfg.run.run_dir).groups[f"{cfg.broker.topic_prefix}rollout"] == {"prompts": {1: 3}}

    fresh = EmbeddedBroker().start()
    try:
        target = cfg.with_overrides(broker={"bootstrap_servers": fresh.bootstrap_servers})
        report = republish(target, cfg.run.run_dir)
        assert raw_dump(target) == source  # same topics, partitions, offsets, keys, headers, timestamps, bytes
        assert report.records["prompts"] == 40 and report.records["deadletter"] == 9
        check = RecordConsumer(target.broker, topics.PROMPTS, f"{cfg.broker.topic_prefix}rollout")
        committed = check.committed([1])
        check.close()
        assert committed == {1: 3}
    finally:
        fresh.stop()


def test_replay_cli_describes_and_republishes(cfg, tmp_path):
    from milestream.cli import main

    produce_mixed(cfg, 0, 3)
    archive_until_idle(cfg, idle_s=3.0)
    assert main(["replay", "--run-dir", cfg.run.run_dir]) == 0
    fresh = EmbeddedBroker().start()
    try:
        assert main(["replay", "--republish", "--run-dir", cfg.run.run_dir,
                     "--bootstrap-servers", fresh.bootstrap_servers]) == 0
        assert raw_dump(cfg.with_overrides(broker={"bootstrap_servers": fresh.bootstrap_servers})) == raw_dump(cfg)
    finally:
        fresh.stop()


# ---- a run whose broker restarts mid-run resumes from the archive ------------------------------

def assert_running(children, what: str) -> None:
    for child in children:
        if child.proc.poll() is not None:
            raise AssertionError(f"{child.name} exited ({child.proc.returncode}) while waiting for {what}")


def wait_until(condition, timeout_s: float, what: str, children=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert_running(children, what)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.5)


class Outcomes:
    """The run's lineage (trained groups, drops), read as it lands."""

    def __init__(self, cfg):
        self.feed = TopicFeed(cfg, "audit", specs=(topics.METRICS, topics.DROPPED))
        self.lineage = Lineage()

    def catch_up(self) -> Lineage:
        for item in self.feed.drain(0.2, 5.0):
            self.lineage.observe(item.record, item.position)
        return self.lineage

    def close(self) -> None:
        self.feed.close()


def archived_records(run_dir, spec) -> list:
    return [r for m in read_archive(run_dir, spec) for r in m.records]


def start_life(cfg, config_path: Path, run_dir: Path, life: int):
    from milestream.orchestrator import start_stages

    logs = run_dir / "logs" / f"life{life}"
    logs.mkdir(parents=True, exist_ok=True)
    children, trainer = start_stages(cfg, config_path, logs)
    assert children[0].name == "archiver"  # started first, stopped last
    return children, trainer


def stop_life(children) -> None:
    """Stages first (the trainer checkpoints, the processor commits), then the archiver drains."""
    archiver, *stages = children
    for child in reversed(stages):
        child.stop(grace=120.0 if child.name == "trainer" else 30.0)
    archiver.stop(grace=60.0)
    for child in children:  # -9: killed on purpose by kill_rollout_mid_group
        assert child.proc.returncode in (0, -15, -9), f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}"


def kill_rollout_mid_group(cfg, children, holds: Holds) -> None:
    """SIGKILL the rollout worker held after its HELD_AT_SAMPLE-th sample, with a group half published
    as a crash would leave it: some samples on the log, the rest never generated, the prompt's offset
    not committed. The worker cannot finish that group while it holds."""

    holds.wait_held("worker.sample_published", 300, lambda: assert_running(children, "the held worker"))
    reader = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    samples: collections.Counter[str] = collections.Counter()

    def half_published() -> bool:  # the held worker's samples reach the topic; no more come
        samples.update(t.group_id for d in reader.drain(0.05, 1.0) for t in d.records)
        return sum(samples.values()) == HELD_AT_SAMPLE and any(0 < n < cfg.rollout.group_size for n in samples.values())

    try:
        wait_until(half_published, 60, "the held worker's samples, one group half published", children)
    finally:
        reader.close()
    for child in (c for c in children if c.name.startswith("rollout")):
        child.proc.kill()
        child.proc.wait()


def dump_logs(run_dir: Path) -> None:
    for log in sorted((run_dir / "logs").glob("*/*.log")):
        print(f"==== {log.parent.name}/{log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))


def restart_broker(broker: EmbeddedBroker) -> EmbeddedBroker:
    """The in-memory broker goes, and with it every record and committed offset; a new, empty one
    comes up on the same port, so the stages' configuration stays valid."""
    broker.proc.kill()
    broker.proc.wait()
    restarted = EmbeddedBroker()
    restarted.port = broker.port
    return restarted.start()


def audit_archive(run_dir: Path, entered: set[str]) -> None:
    """The whole run, both brokers, as the archive holds it."""
    versions = [v.version for v in archived_records(run_dir, topics.WEIGHT_VERSIONS)]
    assert versions == list(range(1, len(versions) + 1))  # no version skipped or published twice
    for spec in topics.CATALOGUE:  # one archive across both brokers: every offset once, dense from 0
        table = read_topic(run_dir, spec.name, ["partition", "offset"])
        for partition in set(table["partition"].to_pylist()):
            offsets = [o for p, o in zip(table["partition"].to_pylist(), table["offset"].to_pylist()) if p == partition]
            assert offsets == list(range(len(offsets))), (spec.name, partition)
    lineage = archived_lineage(run_dir)
    trained = lineage.training().keys()
    assert entered <= trained | lineage.drops.keys()  # no group lost
    assert trained <= lineage.emitted.keys() and not lineage.trained_and_dropped()
    assert not lineage.trained_twice()  # the resumed trainer did not train a group again


def test_run_survives_broker_restart(cfg, tmp_path, monkeypatch):
    from milestream.train import checkpoint
    from milestream.log.restore import resume

    broker = EmbeddedBroker().start()
    run = cfg.with_overrides(broker={"bootstrap_servers": broker.bootstrap_servers},
                             trainer={"steps": 40, "checkpoint_every": 1}, run={"max_wall_s": 600})
    assert HELD_AT_SAMPLE % run.rollout.group_size and run.rollout.num_workers == 1
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("worker.sample_published", at_pass=HELD_AT_SAMPLE)
    run_dir = Path(run.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(run.to_yaml())
    children: list = []
    try:
        children, trainer = start_life(run, config_path, run_dir, 1)
        # the worker holds once it has admitted 8 groups, which the credit (4) allowed only after the
        # trainer took 4, none of them stale (versions 0 and 1): two steps come, and no more groups
        wait_until(lambda: (checkpoint.load_latest(run_dir) or {"state": {"step": 0}})["state"]["step"] >= 2,
                   400, "two trainer steps before the restart", children)
        kill_rollout_mid_group(run, children, holds)
        stop_life(children)
        entered = {t.group_id for t in archived_records(run_dir, topics.TRAJECTORIES)}
        resumed_from = checkpoint.load_latest(run_dir)["state"]["step"]

        broker = restart_broker(broker)
        before = BufferLedger(run).available()  # what the stopped run left in Redis
        report, accounting = resume(run, run_dir)
        assert report.records["rollout.trajectories"] == len(archived_records(run_dir, topics.TRAJECTORIES))
        assert {f"{run.broker.topic_prefix}rollout", f"{run.broker.topic_prefix}milestream-processor"} <= report.groups.keys()
        assert set(accounting.queued) <= {g.group_id for g in archived_records(run_dir, topics.GROUPS)}
        assert BufferLedger(run).queued() == len(accounting.queued)
        sizes = collections.Counter(t.group_id for t in archived_records(run_dir, topics.TRAJECTORIES))
        print(f"restart: {len(entered)} groups entered ({sum(n < run.rollout.group_size for n in sizes.values())} "
              f"half published), trainer at step {resumed_from}; credit {before} -> {accounting}")

        children, trainer = start_life(run, config_path, run_dir, 2)
        outcomes = Outcomes(run)
        def settled() -> bool:
            lineage = outcomes.catch_up()
            return not entered - (lineage.training().keys() | lineage.drops.keys()) \
                and max(lineage.steps, default=0) >= resumed_from + 2

        # a trainer done with all its steps has trained all it will: settled by then, or never
        wait_until(lambda: trainer.proc.poll() is not None or settled(), 500,
                   "every group that entered before the restart to be trained or dropped",
                   [c for c in children if c is not trainer])
        assert trainer.proc.returncode in (None, 0), trainer.tail()
        assert settled(), "the trainer finished its steps before every group that entered was trained or dropped"
        outcomes.close()
        stop_life(children)
    except BaseException:
        for child in children:
            child.stop(grace=5.0)
        dump_logs(run_dir)
        raise
    finally:
        broker.stop()

    assert "resumed at step" in (run_dir / "logs" / "life2" / "trainer.log").read_text()
    audit_archive(run_dir, entered)
