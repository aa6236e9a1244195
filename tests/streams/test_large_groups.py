"""A group larger than a broker message: MoE routing (R3) of the tiny MoE, every record under a small
``broker.max_message_bytes`` and the group's records together several times over it. The processor is
SIGKILLed holding the group half assembled (a hold point), comes back, rebuilds the group from the log and
emits its manifest; the trainer reads the records where the manifest says and trains a step on them,
replaying their routing. The audit of the log is exact, and the step recomputed from the log alone (its
records joined as the trainer joined them, routing included) matches the logged one bit for bit."""
from __future__ import annotations

import asyncio

import numpy as np
from synthetic import ProcessorProcess, admit

from holds import Holds
from milestream.engines.engine import CpuEngine, GenerateRequest, SamplingParams
from milestream.engines.moe_routing import routing_records
from milestream.infra.kafka import RecordProducer
from milestream.infra.secret_env import stage_environment
from milestream.log.audit import audit_run
from milestream.log.reader import BrokerSource
from milestream.log.samples import logged_samples
from milestream.observe.redrive import redrive_trainer
from milestream.orchestrator import Child
from milestream.schemas import routing, topics
from milestream.schemas.codec import encode
from milestream.schemas.records import LogProbs, Trajectory

LIMIT = 4096  # broker.max_message_bytes: each record fits, the group does not
PROMPT = (1, 17, 230, 4051, 9, 77, 12)
GROUP = "big#0"


def rollout(cfg) -> tuple[list, dict[int, np.ndarray]]:
    """The group's records as a rollout worker publishes them, and each sample's recorded routing."""
    engine = CpuEngine(cfg.model, cfg.rollout, seed=5)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)

    async def generate():
        return await asyncio.gather(*(engine.generate(GenerateRequest(f"r{i}", PROMPT, sampling))
                                      for i in range(cfg.rollout.group_size)))
    try:
        results = asyncio.run(generate())
    finally:
        asyncio.run(engine.close())
    records, recorded = [], {}
    for i, result in enumerate(results):
        sample_id, n = f"{GROUP}/{i}", len(result.output_ids)
        chunks = routing_records(sample_id, GROUP, i, len(results), result.routing)
        records += [(topics.TRAJECTORIES, Trajectory(sample_id, GROUP, "big", i, len(results), list(PROMPT),
                                                     list(result.output_ids), [1] * n, list(result.versions),
                                                     float(i % 2), "truncated", "", "e", "w", 0.0, 0.0, len(chunks))),
                    (topics.LOGPROBS, LogProbs(sample_id, GROUP, i, len(results), list(result.logprobs)))]
        records += [(topics.ROUTING, chunk) for chunk in chunks]
        recorded[i] = np.sort(result.routing.expert_ids, axis=2)
    return records, recorded


def publish(cfg, records) -> None:
    producer = RecordProducer(cfg.broker, client_id="large-group-test")
    for spec, record in records:
        producer.send(spec, [record], key=GROUP)
    producer.flush()


def test_a_group_over_the_message_limit_trains_with_its_routing_after_a_processor_kill(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(model={"name": "tiny-moe", "lora_rank": 0}, broker={"max_message_bytes": LIMIT},
                             trainer={"batch_groups": 1, "steps": 1, "routing_replay": True})
    records, recorded = rollout(cfg)
    sizes = [len(encode([record])) for _, record in records]
    print(f"{len(sizes)} records, the largest {max(sizes)} B, together {sum(sizes)} B; the limit {LIMIT} B")
    assert max(sizes) < LIMIT and sum(sizes) > 2 * LIMIT, sizes
    admit(cfg, [GROUP])
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("processor.took")  # it holds after taking its first records: the group is half assembled
    processor = ProcessorProcess(cfg, tmp_path)
    processor.start()
    trainer = None
    try:
        publish(cfg, records[: len(records) // 2])
        held = holds.wait_held("processor.took", 120, processor.assert_alive)
        processor.kill()
        holds.release("processor.took", held)
        processor.start()
        publish(cfg, records[len(records) // 2:])
        config_path = tmp_path / "trainer.yaml"
        config_path.write_text(cfg.to_yaml())
        trainer = Child("trainer", ["train"], config_path, tmp_path, stage_environment(cfg))
        assert trainer.proc.wait(300) == 0, trainer.tail()
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        if trainer is not None:
            trainer.stop()
        processor.stop()
    source = BrokerSource(cfg, idle_s=1.0)
    audit = audit_run(cfg.run.run_dir, source)
    assert audit.exact and (audit.groups_emitted, audit.groups_trained, audit.steps) == (1, 1, 1), audit
    (manifest,) = [m.records for m in source.messages(topics.GROUPS)][:1]
    assert len(encode(manifest)) < LIMIT and [len(row.routing_offsets) for row in manifest] == [1] * len(manifest)
    samples = logged_samples(source)[GROUP]
    assert all(np.array_equal(routing.expert_ids(s), recorded[s.sample_index]) for s in samples)
    (replayed,) = redrive_trainer(cfg, cfg.run.run_dir, source, 1, 1)
    assert replayed.bitwise_equal, (replayed.logged, replayed.replayed)
