"""A group still incomplete after ``buffer.incomplete_after_s`` leaves on buffer.dropped, reason
``incomplete``, and its credit comes back once; a complete group beside it is emitted as usual."""
from __future__ import annotations

from synthetic import ProcessorProcess, admit, group_records, topic_reader, wait_until

from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger

GROUP_SIZE = 4


def test_group_incomplete_after_the_window_is_dropped_with_its_reason(cfg, tmp_path):
    cfg = cfg.with_overrides(buffer={"incomplete_after_s": 1.0})
    admit(cfg, ["partial#0", "whole#0"])
    producer = RecordProducer(cfg.broker, client_id="incomplete-test")
    missing_one_trajectory = group_records("partial#0", GROUP_SIZE)[1:]
    for spec, record in missing_one_trajectory + group_records("whole#0", GROUP_SIZE):
        producer.send(spec, [record], key=record.group_id)
    producer.flush()
    credit = BufferLedger(cfg)
    credit_before = credit.available()

    processor = ProcessorProcess(cfg, tmp_path)
    processor.start()
    dropped_reader, groups_reader = topic_reader(cfg, topics.DROPPED), topic_reader(cfg, topics.GROUPS)
    dropped, emitted = [], []
    try:
        def both_left() -> bool:
            processor.assert_alive()
            dropped.extend(r for d in dropped_reader.drain(idle_s=0.2) for r in d.records)
            emitted.extend(d.records[0].group_id for d in groups_reader.drain(idle_s=0.2))
            return bool(dropped) and bool(emitted)
        wait_until(both_left, 120, "the partial group on buffer.dropped and the whole one on buffer.groups")
        # the credit comes back when the drop is delivered and settled, a moment after it is readable
        wait_until(lambda: credit.available() == credit_before + 1, 30, "the dropped group's credit")
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        processor.stop()
        dropped_reader.close()
        groups_reader.close()

    (record,) = dropped
    assert (record.group_id, record.reason, record.dropped_by) == ("partial#0", "incomplete", "processor")
    assert record.detail == f"{GROUP_SIZE - 1}/{GROUP_SIZE} trajectories, {GROUP_SIZE} log-probs, 0 routing chunks"
    assert record.num_samples == GROUP_SIZE - 1
    assert emitted == ["whole#0"]
