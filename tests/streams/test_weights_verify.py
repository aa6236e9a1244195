"""Verified delivery: a corrupted or missing tensor is refused by the receiving engine and flagged
by the verifier consumer (log line + Metrics on buffer.metrics); the start-up noise check proves an
update overwrote every trainable tensor."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from milestream.config import Config
from milestream.infra.kafka import Delivery, RecordConsumer, RecordProducer
from milestream.infra.model import load_model, load_tokenizer, trainable_state_dict
from milestream.engines.engine import CpuEngine
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import WeightVersion
from milestream.streams import weights as weights_package
from milestream.streams.weights import WeightVerificationError, acknowledge, make_receiver, make_sender
from milestream.streams.weights.verify import NoiseCheck, WeightVerifier, held_mismatches


def initial_tensors(cfg: Config, shift: float = 0.0) -> dict[str, torch.Tensor]:
    model = load_model(cfg.model, dtype=torch.float32)
    return {name: t.detach().clone() + shift for name, t in trainable_state_dict(model).items()}


def judge_all(verifier: WeightVerifier, count: int, timeout_s: float = 60.0) -> list:
    judged, deadline = [], time.monotonic() + timeout_s
    while len(judged) < count and time.monotonic() < deadline:
        judged += verifier.poll(0.5)
    return judged


def last_verifier_metrics(cfg: Config, timeout_s: float = 30.0):
    consumer = RecordConsumer(cfg.broker, topics.METRICS, "test-metrics").assign(partitions=[0])
    records, deadline = [], time.monotonic() + timeout_s
    while not records and time.monotonic() < deadline:  # the first fetch may come back empty
        records = [r for d in consumer.drain(1.0, 10.0) for r in d.records if r.source == "verifier"]
    consumer.close()
    return records[-1]


def flip_byte(path: Path, from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-from_end] ^= 0x40
    path.write_bytes(bytes(raw))


def test_the_verifier_flags_corrupted_missing_unknown_and_refused(cfg: Config, caplog) -> None:
    producer = RecordProducer(cfg.broker)
    tensors = initial_tensors(cfg)
    record = make_sender(cfg).publish(producer, 1, 1, tensors)
    name = record.tensor_names[0]
    acknowledge(producer, "good", record, tensors)
    acknowledge(producer, "corrupted", record, {**tensors, name: tensors[name] + 1e-3})
    acknowledge(producer, "missing", record, {n: t for n, t in tensors.items() if n != name})
    acknowledge(producer, "unknown", replace(record, version=99), tensors)
    acknowledge(producer, "refused", record, None, error="checksum mismatch on 1 tensors")
    producer.flush()

    verifier = WeightVerifier(cfg, unknown_grace_s=1.0)
    with caplog.at_level(logging.ERROR, logger="milestream.streams.weights.verify"):
        problems = {ack.engine_id: problem for ack, problem in judge_all(verifier, 5)}
    verifier.close()
    assert problems["good"] is None
    assert f"checksum differs on ['{name}'] (1)" in problems["corrupted"]
    assert f"missing tensors ['{name}'] (1)" in problems["missing"]
    assert "version 99, which weights.versions never announced" in problems["unknown"]
    assert "refused version 1: checksum mismatch" in problems["refused"]
    logged = [r.getMessage() for r in caplog.records if "weight mismatch" in r.getMessage()]
    assert len(logged) == 4 and any("engine corrupted holds version 1 wrongly" in line for line in logged)
    assert last_verifier_metrics(cfg).values == {"weights_verified": 1.0, "weights_mismatched": 4.0}


@pytest.mark.parametrize("transport", ["disk", "disk-delta"])
def test_a_corrupted_or_missing_tensor_is_refused_by_the_engine_and_flagged(cfg: Config, transport: str) -> None:
    """The worker's own path: receive, refuse, acknowledge the refusal; the verifier flags it."""
    cfg = cfg.with_overrides(weights={"transport": transport})
    producer, sender = RecordProducer(cfg.broker), make_sender(cfg)
    first = sender.publish(producer, 1, 1, initial_tensors(cfg, shift=0.01))
    second = sender.publish(producer, 2, 2, initial_tensors(cfg, shift=0.02))
    engine = CpuEngine(cfg.model, cfg.rollout)
    worker = RolloutWorker(cfg, "w-verify", engine, load_tokenizer(cfg.model))
    receiver = make_receiver(cfg, "w-verify")

    async def apply(record: WeightVersion) -> None:
        await worker._apply(receiver, record, Delivery(Position(), None, [record], 0.0), None)

    asyncio.run(apply(first))
    assert engine.version == 1
    assert Path(second.location).suffix == (".delta" if transport == "disk-delta" else ".safetensors")
    flip_byte(Path(second.location), from_end=7)  # inside the last tensor's bytes (or its zstd frame)
    with pytest.raises(WeightVerificationError):
        receiver.receive(second)
    asyncio.run(apply(second))
    assert engine.version == 1  # refused: the engine keeps what it had

    third = make_sender(cfg.with_overrides(weights={"transport": "disk"})).publish(
        producer, 3, 3, initial_tensors(cfg, shift=0.03))
    kept = dict(list(initial_tensors(cfg, shift=0.03).items())[1:])  # a file that lost a tensor
    save_file(kept, third.location)
    with pytest.raises(WeightVerificationError, match="missing tensors"):
        make_receiver(cfg.with_overrides(weights={"transport": "disk"}), "x").receive(third)

    worker.close()
    verifier = WeightVerifier(cfg)
    judged = {ack.version: problem for ack, problem in judge_all(verifier, 2)}
    verifier.close()
    asyncio.run(engine.close())
    assert judged[1] is None
    assert "refused version 2" in judged[2] and ("checksum" in judged[2] or "decoded" in judged[2])
    assert (verifier.verified, verifier.mismatched) == (1, 1)


def test_a_version_pruned_before_an_engine_loads_it_is_passed_over_not_refused(cfg: Config, monkeypatch) -> None:
    """A worker (re)starting while the trainer moves on meets versions whose files were pruned: it passes them
    over for the newer one, with no refusal on weights.applied and no dead letter; a record naming a file that
    was never written (no newer version beside it) is still refused and dead-lettered."""
    cfg = cfg.with_overrides(weights={"transport": "disk"}, trainer={"keep_weight_versions": 2})
    producer, sender = RecordProducer(cfg.broker), make_sender(cfg)
    announced = [sender.publish(producer, v, v, initial_tensors(cfg, shift=0.01 * v)) for v in (1, 2, 3)]
    assert not Path(announced[0].location).exists()  # pruned once version 3 was written
    engine = CpuEngine(cfg.model, cfg.rollout)
    worker = RolloutWorker(cfg, "w-pruned", engine, load_tokenizer(cfg.model))
    acks, letters = [], []
    monkeypatch.setattr(weights_package, "acknowledge", lambda *args, **kwargs: acks.append(kwargs.get("error")))
    monkeypatch.setattr(worker.producer, "dead_letter", lambda position, error, *rest: letters.append(str(error)))
    receiver = make_receiver(cfg, "w-pruned")

    def apply(record: WeightVersion) -> bool:
        return asyncio.run(worker._apply(receiver, record, Delivery(Position(), None, [record], 0.0), None))

    assert not apply(announced[0]) and (engine.version, acks, letters) == (0, [], [])
    never_written = replace(announced[2], version=9, location=str(Path(announced[2].location).with_name("v000009.safetensors")))
    assert not apply(never_written)
    assert acks and "never written" in acks[0] and len(letters) == 1
    assert apply(announced[2]) and engine.version == 3
    worker.close()
    asyncio.run(engine.close())


def test_the_noise_check_catches_a_tensor_the_update_missed(cfg: Config) -> None:
    engine = CpuEngine(cfg.model, cfg.rollout)
    delivered = initial_tensors(cfg, shift=0.01)
    noise = NoiseCheck(engine.model)
    noise.fill()
    assert held_mismatches(engine.model, delivered) == sorted(delivered)  # every tensor is noise now
    # an update path that forgets one tensor: that tensor is still noise, and the check says so
    skipped = sorted(delivered)[-1]
    with torch.no_grad():
        for name, tensor in trainable_state_dict(engine.model).items():
            if name != skipped:
                tensor.copy_(delivered[name])
    with pytest.raises(WeightVerificationError, match=f"still holds 1 tensors .*{skipped}"):
        noise.compare(1, delivered)
    assert noise.pending
    asyncio.run(engine.update_weights(1, delivered))
    noise.compare(1, delivered)
    assert not noise.pending
    asyncio.run(engine.close())


def test_a_noise_checked_worker_generates_only_after_its_first_version(cfg: Config) -> None:
    cfg = cfg.with_overrides(weights={"noise_check": True})
    engine = CpuEngine(cfg.model, cfg.rollout)
    worker = RolloutWorker(cfg, "w-noise", engine, load_tokenizer(cfg.model))
    acks = RecordConsumer(cfg.broker, topics.WEIGHTS_APPLIED, "test").assign(partitions=range(cfg.broker.partitions))

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(3.0)
        assert not worker.weights_ready.is_set()  # noise in the engine: nothing may be admitted
        # the trainer's initial weights, version 0 (train/trainer.py publishes them under noise_check)
        make_sender(cfg).publish(RecordProducer(cfg.broker), 0, 0, initial_tensors(cfg))
        await asyncio.wait_for(worker.weights_ready.wait(), timeout=60)
        stop.set()
        await task

    asyncio.run(run())
    delivery = acks.poll(30.0)
    ack = delivery.records[0]
    assert (ack.engine_id, ack.version, ack.ok) == ("w-noise", 0, True)
    assert held_mismatches(engine.model, initial_tensors(cfg)) == []
    asyncio.run(engine.close())
    acks.close()
