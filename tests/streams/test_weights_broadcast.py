"""The broadcast transport: one trainer rank (this process) and two engine processes in a gloo group
of their own. Engines read the record from weights.versions on the real broker, join the group on
their first version and return tensors whose checksums match the record; a byte corrupted in a
bucket on the way is caught by each engine's check, and an engine that skipped a version still
takes part in its broadcast and returns the newer one.
"""
from __future__ import annotations

import pytest
import torch
from weight_engines import TIMEOUT_S, outcomes, start_engines, tiny_model_tensors

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.streams.weights import broadcast
from milestream.streams.weights.buckets import plan_buckets

ENGINES = [("worker-0", {"device": "cpu"}), ("worker-1", {"device": "cpu"})]
LABELS = ["worker-0/0", "worker-1/0"]


def test_publish_delivers_a_tiny_model_to_two_engine_processes(cfg):
    tensors = tiny_model_tensors()
    cfg = cfg.with_overrides(weights={"transport": "broadcast", "bucket_mb": 1}, rollout={"num_workers": 2})
    sender = broadcast.BroadcastSender(cfg, timeout_s=TIMEOUT_S, device="cpu")
    procs, results = start_engines(broadcast.BroadcastReceiver, cfg, ENGINES, want=2)
    producer = RecordProducer(cfg.broker)
    first = sender.publish(producer, 1, 10, tensors)
    tensors["model.norm.weight"] += 1  # the next version differs, and must arrive as such
    second = sender.publish(producer, 2, 11, tensors)
    sender.close()
    assert len(plan_buckets(tensors, 2, 1).bucket_sizes) > 2  # several buckets travelled
    got = outcomes(procs, results, 4)
    assert [(label, v, status) for label, v, status, _ in got] == [(label, v, "ok") for label in LABELS for v in (1, 2)]
    for _, version, _, (names, sums, _) in got:
        record = first if version == 1 else second
        assert names == record.tensor_names and sums == record.checksums
    assert first.checksums != second.checksums and first.location.startswith("tcp://127.0.0.1:")


def test_a_byte_corrupted_in_a_bucket_is_caught_by_every_engine(monkeypatch):
    cfg = Config().with_overrides(weights={"bucket_mb": 1})
    tensors = tiny_model_tensors()
    sender = broadcast.BroadcastSender(cfg, num_engines=2, timeout_s=TIMEOUT_S, device="cpu")
    record, manifest = sender.prepare(1, 1, tensors)
    real_pack = broadcast.pack_bucket

    def corrupting_pack(tensors, manifest, index, staging=None):
        bucket = real_pack(tensors, manifest, index, staging)
        if index == 1:
            bucket[manifest.in_bucket(1)[0].offset] ^= 0xFF  # one byte flipped on the wire
        return bucket

    monkeypatch.setattr(broadcast, "pack_bucket", corrupting_pack)
    procs, results = start_engines(broadcast.BroadcastReceiver, cfg, ENGINES, [record])
    sender.send(manifest, tensors)
    sender.close()
    got = outcomes(procs, results, 2)
    assert [(label, status) for label, _, status, _ in got] == [(label, "rejected") for label in LABELS]
    assert all("checksum mismatch on 1 tensors" in detail for *_, detail in got)


def test_an_engine_that_skipped_a_version_drains_it_and_returns_the_newer_one():
    cfg = Config().with_overrides(weights={"bucket_mb": 1})
    tensors = {"model.layers.0.mlp.up_proj.weight": torch.randn(128, 64), "model.norm.weight": torch.ones(64)}
    sender = broadcast.BroadcastSender(cfg, num_engines=1, timeout_s=TIMEOUT_S, device="cpu")
    _, old_manifest = sender.prepare(1, 1, tensors)
    newer = {name: t * 2 for name, t in tensors.items()}
    new_record, new_manifest = sender.prepare(2, 2, newer)
    procs, results = start_engines(broadcast.BroadcastReceiver, cfg, ENGINES[:1], [new_record])
    sender.send(old_manifest, tensors)
    sender.send(new_manifest, newer)
    sender.close()
    ((_, version, status, (names, sums, _)),) = outcomes(procs, results, 1)
    assert (version, status, names, sums) == (2, "ok", new_record.tensor_names, new_record.checksums)


def test_a_missing_engine_is_a_clear_timeout():
    sender = broadcast.BroadcastSender(Config(), num_engines=1, timeout_s=2.0, device="cpu")
    _, manifest = sender.prepare(1, 1, {"w": torch.ones(4)})
    with pytest.raises(broadcast.WeightTransferError, match="could not connect to all ranks within 2s"):
        sender.send(manifest, {"w": torch.ones(4)})
