"""Engine processes for the weight transport tests: each builds a receiver, takes the records it is
handed (or reads them from weights.versions on the broker as they arrive), and reports per version
what it received, as (engine id, version, "ok" | "rejected" | "error", (names, checksums, shapes))."""
from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator

import torch

from milestream.config import Config, ModelConfig
from milestream.infra.kafka import RecordConsumer
from milestream.schemas import topics
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import WeightVerificationError, checksums

TIMEOUT_S = 40.0


def tiny_model_tensors() -> dict[str, torch.Tensor]:
    """The tiny Llama's full state (real names and shapes), one tensor in bf16 so dtypes share a bucket."""
    from milestream.infra.model import load_model  # transformers: 5+ s that engine processes need not pay

    model = load_model(ModelConfig(name="tiny-random", lora_rank=0), dtype=torch.float32)
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    return tensors


def engine_main(receiver_cls, cfg: Config, engine_id: str, options: dict, records: list[WeightVersion] | None,
                want: int, results) -> None:
    torch.set_num_threads(1)
    receiver = receiver_cls(cfg, engine_id, timeout_s=TIMEOUT_S, **options)
    label = f"{engine_id}/{options.get('tp_rank', 0)}"
    try:
        for record in records or read_versions(cfg, label, want):
            try:
                tensors = receiver.receive(record)
                names, sums = checksums(tensors)
                results.put((label, record.version, "ok", (names, sums, [tuple(tensors[n].shape) for n in names])))
            except WeightVerificationError as exc:
                results.put((label, record.version, "rejected", str(exc)))
    except Exception as exc:  # the test reads every outcome, failures included
        results.put((label, -1, "error", repr(exc)))
    finally:
        receiver.close()


def read_versions(cfg: Config, label: str, want: int) -> Iterator[WeightVersion]:
    """Records as they arrive: the next one is only published once this one has been delivered."""
    consumer = RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, f"{label}-test").assign(partitions=[0])
    deadline = time.monotonic() + TIMEOUT_S
    while want and time.monotonic() < deadline:
        delivery = consumer.poll(0.5)
        for record in delivery.records if delivery is not None else []:
            want -= 1
            yield record
    consumer.close()


def start_engines(receiver_cls, cfg: Config, engines: list[tuple[str, dict]],
                  records: list[WeightVersion] | None = None, want: int = 1):
    """One spawned process per (engine id, receiver options)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=engine_main, args=(receiver_cls, cfg, engine_id, options, records, want, results),
                         daemon=True) for engine_id, options in engines]
    for proc in procs:
        proc.start()
    return procs, results


def outcomes(procs, results, count: int) -> list[tuple]:
    got = [results.get(timeout=TIMEOUT_S + 30) for _ in range(count)]
    for proc in procs:
        proc.join(timeout=30)
    return sorted(got, key=lambda outcome: outcome[:2])
