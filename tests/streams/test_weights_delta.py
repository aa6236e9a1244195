"""The disk-delta transport: payload size, the chain an engine walks, and a model delivered by real
optimizer steps to two rollout-worker processes (``milestream rollout``) over the real broker, both
engines started from noise, every ack checked by the verifier."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from milestream.config import Config, ModelConfig
from milestream.infra.kafka import Delivery, RecordConsumer, RecordProducer
from milestream.infra.model import load_model, load_tokenizer, trainable_state_dict
from milestream.infra.services import die_with_parent
from milestream.engines.engine import CpuEngine, GenerateRequest, SamplingParams
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import WeightApplied
from milestream.streams.weights import NO_BASE, WeightVerificationError, checksums, make_receiver, make_sender
from milestream.streams.weights.delta import DeltaReceiver, DeltaSender, delta_path, read_delta
from milestream.streams.weights.disk import full_path
from milestream.streams.weights.verify import WeightVerifier


def optimizer_steps(model_cfg: ModelConfig, lr: float, dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """The trainable tensors after each real AdamW step on a language-modelling loss (fp32 master
    weights, exported in ``dtype``), starting with the initial ones."""
    torch.manual_seed(seed)
    model = load_model(model_cfg, dtype=torch.float32).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    while True:
        yield {name: t.detach().to(dtype).clone() for name, t in trainable_state_dict(model).items()}
        ids = torch.randint(0, 1000, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def delta_cfg(cfg: Config, **weights: object) -> Config:
    return cfg.with_overrides(weights={"transport": "disk-delta", **weights}, trainer={"keep_weight_versions": 10})


def full_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("encoding", ["sparse", "xor"])
def test_a_delta_of_few_changed_elements_is_a_small_fraction_of_full(cfg: Config, encoding: str) -> None:
    cfg = delta_cfg(cfg, delta_encoding=encoding)
    base = next(optimizer_steps(ModelConfig(name="tiny-random", lora_rank=0), lr=0.0, dtype=torch.bfloat16))
    changed = {name: t.clone() for name, t in base.items()}
    for tensor in changed.values():  # one element in a thousand moves by one bf16 step
        flat = tensor.view(-1)
        picked = torch.randperm(flat.numel())[: max(1, flat.numel() // 1000)]
        flat[picked] = torch.nextafter(flat[picked], torch.full_like(flat[picked], float("inf")))
    sender, producer = DeltaSender(cfg), RecordProducer(cfg.broker)
    first = sender.publish(producer, 1, 1, base)
    second = sender.publish(producer, 2, 2, changed)
    assert (first.base_version, second.base_version) == (NO_BASE, 1)
    assert first.num_bytes == full_bytes(base)
    fraction = second.num_bytes / full_bytes(changed)
    assert fraction < 0.01, fraction  # 0.1% of the elements changed
    receiver = DeltaReceiver(cfg, "e")
    receiver.receive(first)
    assert checksums(receiver.receive(second)) == (second.tensor_names, second.checksums)


def test_real_optimizer_steps_in_bf16_cost_a_fraction_of_the_full_version(cfg: Config) -> None:
    """AdamW at an RL learning rate moves every fp32 weight, but only a few percent of them across a
    bf16 rounding step: the delta of the bf16 export is a small part of the full version."""
    cfg = delta_cfg(cfg)
    steps = optimizer_steps(ModelConfig(name="tiny-random", lora_rank=0), lr=1e-6, dtype=torch.bfloat16)
    sender, producer, receiver = DeltaSender(cfg), RecordProducer(cfg.broker), DeltaReceiver(cfg, "e")
    for version in range(1, 4):
        tensors = next(steps)
        record = sender.publish(producer, version, version, tensors)
        assert checksums(receiver.receive(record)) == (record.tensor_names, record.checksums)
    assert record.transport == "disk-delta" and record.base_version == 2
    assert record.num_bytes / full_bytes(tensors) < 0.1  # measured 0.02-0.03 on the tiny model


def test_an_engine_rebuilds_a_skipped_chain_and_reports_a_gap(cfg: Config) -> None:
    cfg = delta_cfg(cfg, full_every=4)
    steps = optimizer_steps(cfg.model, lr=1e-3)
    sender, producer = make_sender(cfg), RecordProducer(cfg.broker)
    records = [sender.publish(producer, v, v, next(steps)) for v in range(1, 7)]
    folder = Path(records[0].location).parent
    assert [r.base_version for r in records] == [NO_BASE, 1, 2, 3, NO_BASE, 5]  # full at 1 and 5
    assert read_delta(delta_path(folder, 3)).base_version == 2

    late = make_receiver(cfg, "late")  # holds nothing: full version 1, then deltas 2 and 3
    assert checksums(late.receive(records[2])) == (records[2].tensor_names, records[2].checksums)

    behind = make_receiver(cfg, "behind")
    behind.receive(records[0])
    delta_path(folder, 2).unlink()
    with pytest.raises(WeightVerificationError, match=r"cannot rebuild version 3: it holds version 1.*version 2"):
        behind.receive(records[2])
    assert checksums(behind.receive(records[5])) == (records[5].tensor_names, records[5].checksums)  # via full 5


def test_old_versions_are_pruned_but_the_chain_of_the_kept_ones_stays(cfg: Config) -> None:
    cfg = delta_cfg(cfg, full_every=3).with_overrides(trainer={"keep_weight_versions": 2})
    steps = optimizer_steps(cfg.model, lr=1e-3)
    sender, producer = make_sender(cfg), RecordProducer(cfg.broker)
    for version in range(1, 7):  # full at 1 and 4
        record = sender.publish(producer, version, version, next(steps))
    folder = Path(record.location).parent
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == ["v000004.safetensors", "v000005.delta", "v000006.delta"]
    assert full_path(folder, 4).exists()


def test_the_engine_keeps_generating_while_a_delta_is_received(cfg: Config) -> None:
    """The worker decodes, applies and verifies off the event loop; the engine pauses only to load."""
    cfg = delta_cfg(cfg)
    steps = optimizer_steps(cfg.model, lr=1e-3)
    sender, producer = make_sender(cfg), RecordProducer(cfg.broker)
    engine = CpuEngine(cfg.model, cfg.rollout, inflight="keep")
    worker = RolloutWorker(cfg, "w-live", engine, load_tokenizer(cfg.model))
    receiver = make_receiver(cfg, "w-live")
    receiver.receive(sender.publish(producer, 1, 1, next(steps)))
    record = sender.publish(producer, 2, 2, next(steps))
    decode = receiver.receive
    probe_done = threading.Event()

    def slow_receive(record):  # stands in for decoding the delta of a large model; outlasts the probe
        time.sleep(2.0)
        probe_done.wait(120)
        return decode(record)

    receiver.receive = slow_receive

    async def run():
        probe = asyncio.create_task(engine.generate(GenerateRequest("probe", (5, 6, 7), SamplingParams(20, 1.0))))
        probe.add_done_callback(lambda _: probe_done.set())
        started = time.perf_counter()
        await worker._apply(receiver, record, Delivery(Position(), None, [record], 0.0), None)
        return await probe, time.perf_counter() - started

    result, apply_s = asyncio.run(run())
    asyncio.run(engine.close())
    assert engine.version == 2
    assert result.versions == (0,) * 20  # all 20 tokens came while version 2 was being received
    assert engine.update_pause_s < apply_s / 10


# ---- two engine processes --------------------------------------------------------------------------

class EngineProcess:
    """``milestream rollout``: a real rollout worker; with no prompts it only follows weights."""

    def __init__(self, config_path: Path, engine_id: str, log_dir: Path):
        self.engine_id = engine_id
        self.log_path = log_dir / f"{engine_id}.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "milestream.cli", "rollout", "--worker-id", engine_id,
                 "--config", str(config_path)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.log_path.read_text()


def wait_for_acks(acks: RecordConsumer, seen: list[WeightApplied], want: set[tuple[str, int]],
                  engines: list[EngineProcess], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not want <= {(a.engine_id, a.version) for a in seen}:
        for engine in engines:
            assert engine.proc.poll() is None, f"{engine.engine_id} exited:\n{engine.log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no acks {want} after {timeout_s}s; got {[(a.engine_id, a.version) for a in seen]}"
        delivery = acks.poll(0.5)
        seen.extend(delivery.records if delivery else [])


def test_disk_delta_delivers_a_model_to_two_engine_processes(cfg: Config, tmp_path: Path) -> None:
    """Engine a follows versions 1..5 one by one (a full version, then deltas on what it holds);
    engine b starts late and rebuilds version 3 from the full version 1 and the deltas after it.
    Both start from noise, so their first version is also compared against the model they hold."""
    cfg = delta_cfg(cfg, full_every=10, noise_check=True)
    config_path = tmp_path / "engines.yaml"
    config_path.write_text(cfg.to_yaml())
    steps = optimizer_steps(cfg.model, lr=1e-3)  # LoRA adapters, as the loop trains them
    sender, producer = make_sender(cfg), RecordProducer(cfg.broker)
    acks = RecordConsumer(cfg.broker, topics.WEIGHTS_APPLIED, "test-acks").assign(partitions=range(cfg.broker.partitions))
    verifier = WeightVerifier(cfg, group_id="test-verifier")
    engines: list[EngineProcess] = []
    seen: list[WeightApplied] = []
    records = {}
    try:
        engines.append(EngineProcess(config_path, "engine-a", tmp_path))
        for version in range(1, 6):
            records[version] = sender.publish(producer, version, version, next(steps))
            # every engine up has taken it before the next is published: one that read two at once takes the newest
            wait_for_acks(acks, seen, {(engine.engine_id, version) for engine in engines}, engines)
            if version == 3:
                engines.append(EngineProcess(config_path, "engine-b", tmp_path))
                wait_for_acks(acks, seen, {("engine-b", 3)}, engines)
    finally:
        logs = {engine.engine_id: engine.stop() for engine in engines}
    assert [records[v].base_version for v in range(1, 6)] == [NO_BASE, 1, 2, 3, 4]
    assert all(records[v].num_bytes < records[1].num_bytes for v in range(2, 6))  # deltas under the full version
    for ack in seen:
        assert ack.ok, (ack.engine_id, ack.version, ack.detail)
        record = records[ack.version]
        assert (ack.tensor_names, ack.checksums) == (record.tensor_names, record.checksums)
    assert [a.version for a in seen if a.engine_id == "engine-a"] == [1, 2, 3, 4, 5]
    assert [a.version for a in seen if a.engine_id == "engine-b"] == [3, 4, 5]
    for log in logs.values():
        assert "filled with noise" in log and "rejected" not in log
    judged = []
    deadline = time.monotonic() + 60
    while len(judged) < len(seen) and time.monotonic() < deadline:
        judged += verifier.poll(0.5)
    assert (verifier.verified, verifier.mismatched) == (len(seen), 0)
    verifier.close()
