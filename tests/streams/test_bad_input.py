"""Bad input while the whole loop runs: malformed bytes, a record of an unknown schema version and an
oversized record each land on ``deadletter`` with source topic, partition, offset, error and field;
the processor keeps running and the loop completes all its steps."""
from __future__ import annotations

import random
import threading
import time

from stage_runs import run_showing_logs
from synthetic import logprobs, topic_reader, trajectory, wait_until

from milestream.infra.kafka import RawConsumer, RecordProducer, topic_name
from milestream.schemas import topics
from milestream.schemas.codec import encode, headers_for
from milestream.schemas.records import LogProbs, Trajectory

from holds import Holds

MAX_RECORD_BYTES = 256 * 1024  # far below the topics' 8 MiB, so an oversized record still gets published

# A producer from the future: the same record under the next schema version ("LogProbs/2").
FutureLogProbs = type("LogProbs", (LogProbs,), {"VERSION": 2})


def bad_values() -> dict[str, tuple[topics.TopicSpec, bytes, list]]:
    """name -> (topic, value, headers). Each names a group of 2 with one record only: were it taken
    for a good record, it would wait as a partial group and never reach the trainer."""
    future = encode([FutureLogProbs(**logprobs("bad-version#0", 0, 2).to_row())])
    rng = random.Random(0)
    huge = trajectory("bad-oversized#0", 0, 2)
    huge = Trajectory(**{**huge.to_row(), "response_ids": [rng.randrange(49152) for _ in range(300_000)]})
    oversized = encode([huge])
    assert MAX_RECORD_BYTES < len(oversized) < topics.TRAJECTORIES.max_message_mb * 1024 * 1024
    return {
        "malformed": (topics.TRAJECTORIES, b"\x00\x01 not an Arrow IPC stream", []),
        "version": (topics.LOGPROBS, future, headers_for(FutureLogProbs)),
        "oversized": (topics.TRAJECTORIES, oversized, headers_for(Trajectory)),
    }


class Injector(threading.Thread):
    """While the trainer holds after its first step (the loop runs and cannot finish), publishes the
    bad values and lets the trainer go on once all of them are dead-lettered."""

    def __init__(self, cfg, values, holds: Holds):
        super().__init__(name="bad-input", daemon=True)
        self.cfg, self.values, self.holds, self.error, self.injected = cfg, values, holds, None, False

    def run(self) -> None:
        trainer = None
        try:
            trainer = self.holds.wait_held("trainer.published", 240)
            producer = RecordProducer(self.cfg.broker, client_id="bad-input")
            for name, (spec, value, headers) in self.values.items():
                producer.send_raw(spec, value, f"bad-{name}", headers)
            producer.flush()
            self.injected = True
            letters, reader = set(), topic_reader(self.cfg, topics.DEADLETTER)

            def all_dead_lettered() -> bool:
                letters.update(r.key.decode() for d in reader.drain(idle_s=0.2) for r in d.records)
                return {f"bad-{name}" for name in self.values} <= letters

            wait_until(all_dead_lettered, 240, "the bad values dead-lettered")
            reader.close()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test after the loop
            self.error = exc
        finally:
            if trainer is not None:
                self.holds.release("trainer.published", trainer)


def value_at(cfg, topic: str, partition: int, offset: int) -> bytes | None:
    """The value stored at one position of a topic (what a dead letter points to)."""
    consumer = RawConsumer(cfg.broker, f"probe-{time.time()}").assign({(topic, partition): offset})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for message in consumer.consume(1.0, limit=1):
                assert message.offset == offset
                return message.value
        raise AssertionError(f"nothing at {topic}[{partition}]@{offset}")
    finally:
        consumer.close()


def test_bad_input_is_dead_lettered_and_the_loop_completes(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(buffer={"max_record_bytes": MAX_RECORD_BYTES},
                             trainer={"steps": 3, "checkpoint_every": 3}, run={"max_wall_s": 300})
    values = bad_values()
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.published")
    injector = Injector(cfg, values, holds)
    injector.start()
    summary = run_showing_logs(cfg)
    injector.join(timeout=30)
    assert injector.error is None and injector.injected
    assert summary["steps"] == cfg.trainer.steps and summary["stopped_by"] == "steps"

    reader = topic_reader(cfg, topics.DEADLETTER)
    letters = {letter.key.decode(): letter for d in reader.drain(idle_s=3.0) for letter in d.records}
    reader.close()
    assert sorted(letters) == ["bad-malformed", "bad-oversized", "bad-version"]
    expected = {  # name -> (field, words of the error)
        "malformed": ("<value>", "not an Arrow IPC stream"),
        "version": ("<schema>", "schema 'LogProbs/2', expected 'LogProbs/1'"),
        "oversized": ("<value>", f"over buffer.max_record_bytes ({MAX_RECORD_BYTES})"),
    }
    for name, (field, words) in expected.items():
        letter, (spec, value, _) = letters[f"bad-{name}"], values[name]
        assert letter.source_topic == topic_name(cfg.broker, spec)
        assert (letter.field, letter.value) == (field, value)
        assert words in letter.error and f"@{letter.offset}" in letter.error
        assert value_at(cfg, letter.source_topic, letter.partition, letter.offset) == value
