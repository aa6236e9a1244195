"""A seeded sample of hostile records (milestream_testkit/fuzz_records.py) through the real consumers: the stream
processor (its own process) and the trainer's collector, with on-policy distillation off and on (then the
teacher's topic is joined, and fuzzed, too). Each lands on ``deadletter`` naming its topic,
partition, offset and field; the processor stays up; good groups sent among them, some of whose ids the
hostile records claim, are joined and collected as they were sent. And every kind of hostile record of
the other topics is refused by the check its reader runs. ``benchmarks/fuzz.py`` sends 10,000 into a run."""
from __future__ import annotations

import random

import pytest
from milestream_testkit.fuzz_records import GENERIC, HostileRecords
from synthetic import ProcessorProcess, admit, group_records, topic_reader, wait_until

from milestream.config import Config
from milestream.infra.kafka import Admin, RecordProducer
from milestream.log.lineage import check_observed
from milestream.producers.inputs import check_prompt
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, encode
from milestream.streams.ledger import BufferLedger
from milestream.streams.versions import check_applied, check_version
from milestream.train.collector import GroupCollector

SAMPLE = 200
GOOD_GROUPS = 4
PROCESSOR_TOPICS = (topics.TRAJECTORIES, topics.LOGPROBS, topics.ROUTING, topics.WEIGHT_VERSIONS)


def send_interleaved(cfg: Config, hostile: HostileRecords, good: list[str]) -> dict[tuple[str, int, int], str]:
    """The good groups' records (with their teacher's under distill) with SAMPLE hostile ones among them;
    returns where each hostile one landed."""
    rng = random.Random(3)
    teacher = (topics.TEACHER_LOGPROBS,) if cfg.distill.enabled else ()
    specs = [rng.choice([*PROCESSOR_TOPICS, *teacher, topics.GROUPS]) for _ in range(SAMPLE)]
    made = [hostile.make(spec) for spec in specs]
    made = [h for h in made if not h.ignorable and h.kind != "over_broker_limit"]
    good_records = [(spec, record) for gid in good for spec, record in group_records(gid, hostile.size)]
    good_records += [(topics.TEACHER_LOGPROBS, hostile.teacher(gid, i)) for gid in good for i in range(hostile.size)
                     if teacher]
    stream = [("hostile", h) for h in made] + [("good", r) for r in good_records]
    rng.shuffle(stream)
    producer, landed = RecordProducer(cfg.broker, client_id="fuzz-test"), {}
    for what, item in stream:
        if what == "good":
            spec, record = item
            producer.send(spec, [record], key=record.group_id)
        else:
            producer.send_raw(item.spec, item.value, item.key, item.headers,
                              delivered=lambda where, h=item: landed.__setitem__(
                                  (where.topic, where.partition, where.offset), f"{h.spec.name}/{h.kind}"))
    producer.flush()
    assert len(landed) == len(made)
    return landed


@pytest.mark.parametrize("distill", [False, True], ids=["", "distill"])
def test_hostile_records_are_dead_lettered_by_the_processor_and_the_collector(cfg, tmp_path, distill):
    cfg = cfg.with_overrides(buffer={"max_record_bytes": 1024 * 1024},
                             distill={"teacher_path": str(tmp_path)} if distill else {})
    good = [f"good-{i}#0" for i in range(GOOD_GROUPS)]
    admit(cfg, good)
    hostile = HostileRecords(cfg, seed=11)
    hostile.live_groups, hostile.trainer_version = good, 2
    BufferLedger(cfg).raise_trainer_version(hostile.trainer_version)  # as `milestream run` and the trainer do
    landed = send_interleaved(cfg, hostile, good)
    assert distill == any(what.startswith(f"{topics.TEACHER_LOGPROBS.name}/") for what in landed.values())
    producer = RecordProducer(cfg.broker, client_id="fuzz-collector")
    collector = GroupCollector(cfg, producer, {}, Admin(cfg.broker).partitions(topics.GROUPS), set())
    processor = ProcessorProcess(cfg, tmp_path)
    processor.start()
    letters, reader = {}, topic_reader(cfg, topics.DEADLETTER)
    try:
        def all_dead_lettered() -> bool:
            processor.assert_alive()
            collector._read(timeout=0.2)
            producer.flush()
            for delivery in reader.drain(idle_s=0.2):
                letters.update({(r.source_topic, r.partition, r.offset): r for r in delivery.records})
            return landed.keys() <= letters.keys() and collector.pool.keys() >= set(good)
        wait_until(all_dead_lettered, 240, "every hostile record dead-lettered and the good groups collected")
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        processor.stop()
        reader.close()
    for (topic, partition, offset), what in landed.items():
        letter = letters[(topic, partition, offset)]
        assert letter.field and f"[{partition}]@{offset}" in letter.error, (what, letter.field, letter.error)
    assert set(collector.pool) == set(good)  # nothing hostile got into the pool, every good group did
    sent = {gid: [r for spec, r in group_records(gid, hostile.size) if spec is topics.TRAJECTORIES] for gid in good}
    joined = collector._joined(list(collector.pool.values()))  # their records, read where the manifests say
    assert len(joined) == len(good)
    for pooled in joined:
        samples = sorted(pooled.samples, key=lambda s: s.sample_index)
        assert [(s.sample_index, s.response_ids, s.reward) for s in samples] \
            == [(t.sample_index, t.response_ids, t.reward) for t in sent[pooled.group_id]]
        assert all(s.teacher_logprobs == ([-0.25] * len(s.response_ids) if distill else []) for s in samples)
    collector.close()
    assert "Traceback" not in processor.log_path.read_text()  # it never stopped on one, nor logged one


READERS = {  # the checks the other topics' readers run (the verifier judges the rest of weights.applied)
    topics.PROMPTS: lambda cfg, records, at: check_prompt(cfg, records, at),
    topics.WEIGHT_VERSIONS: lambda cfg, records, at: [check_version(cfg, r, at, 2) for r in records],
    topics.WEIGHTS_APPLIED: lambda cfg, records, at: [check_applied(r, at) for r in records],
    **{spec: lambda cfg, records, at: [check_observed(r, at, cfg.trainer.steps, cfg.trainer.batch_groups,
                                                      lambda group: False, False)  # no group was sent
                                       for r in records]
       for spec in (topics.METRICS, topics.DROPPED, topics.EVAL_RESULTS)},
}
JUDGED = {"unknown_version", "wrong_checksums", "forged_refusal"}  # plausible acks: the verifier judges them


@pytest.mark.parametrize("spec", list(READERS), ids=lambda spec: spec.name)
def test_every_hostile_kind_breaks_a_check_of_its_reader(spec):
    cfg = Config().with_overrides(model={"name": "tiny-random"}, rollout={"group_size": 4},
                                  trainer={"steps": 8, "batch_groups": 2})
    hostile = HostileRecords(cfg, seed=5)
    hostile.trainer_version = 2
    kinds = [*GENERIC, *hostile.specific[spec.name]]
    for index, kind in enumerate(kinds):
        at = Position(spec.name, 0, index)
        value = hostile._malformed(spec, kind) if kind in GENERIC else encode(hostile.specific[spec.name][kind]())
        try:
            READERS[spec](cfg, decode(value, spec.record, at), at)
        except RecordError as exc:
            assert exc.field and f"@{index}" in str(exc), (kind, str(exc))
            continue
        assert kind in JUDGED or kind in ("stale_announcement", "other_source_nan"), f"{spec.name}/{kind} passed"
