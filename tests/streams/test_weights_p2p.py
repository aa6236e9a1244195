"""The P2P transport and its transfer plan.

The plan is checked by hand on one Llama layer (a TP=2 engine; a TP=2 trainer feeding TP=1 and
TP=4 engines) and by rebuilding every rank's shards from it. The transport delivers from this
process to two engine processes over ucxx (whole tensors to two engines through the broker, the
shards of one TP=2 engine), over the torch.distributed fallback when ucxx is absent, and a byte
corrupted in a bucket is caught by the receiver's per-piece checksum.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from weight_engines import TIMEOUT_S, outcomes, start_engines, tiny_model_tensors

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.streams.weights import p2p
from milestream.streams.weights.base import checksum
from milestream.streams.weights.plan import Layout, Piece, shard_range, split_dim, transfer_plan

L0 = "model.layers.0."
SHAPES = {  # hidden 4, query rows 8, key rows 4, MLP 8, vocabulary 12, LoRA rank 2
    L0 + "self_attn.q_proj.weight": (8, 4), L0 + "self_attn.k_proj.weight": (4, 4),
    L0 + "self_attn.o_proj.weight": (4, 8), L0 + "mlp.down_proj.weight": (4, 8),
    L0 + "input_layernorm.weight": (4,), "model.embed_tokens.weight": (12, 4),
    L0 + "self_attn.q_proj.lora_A.default.weight": (2, 4), L0 + "self_attn.q_proj.lora_B.default.weight": (8, 2),
    L0 + "self_attn.o_proj.lora_A.default.weight": (2, 8), L0 + "self_attn.o_proj.lora_B.default.weight": (4, 2),
}


def local_shape(full_shape: Sequence[int], name: str, layout: Layout, rank: int) -> tuple[int, ...]:
    """The shape of ``name`` as ``rank`` of ``layout`` holds it."""
    dim = split_dim(name)
    shape = list(full_shape)
    if dim is not None and layout.tp_size > 1:
        start, stop = shard_range(shape[dim], layout.tp_size, layout.tp_rank(rank), name)
        shape[dim] = stop - start
    return tuple(shape)


def names(*suffixes: str) -> list[str]:
    return [name for suffix in suffixes for name in SHAPES if name.endswith(suffix)]


def test_split_dims_follow_megatron_and_vllm():
    dims = {name.removeprefix(L0): split_dim(name) for name in SHAPES}
    assert dims == {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.o_proj.weight": 1,
                    "mlp.down_proj.weight": 1, "input_layernorm.weight": None, "model.embed_tokens.weight": 0,
                    "self_attn.q_proj.lora_A.default.weight": None, "self_attn.q_proj.lora_B.default.weight": 0,
                    "self_attn.o_proj.lora_A.default.weight": 1, "self_attn.o_proj.lora_B.default.weight": None}


def test_a_tp2_engine_gets_exactly_its_shards_from_a_full_sender():
    plan = transfer_plan(SHAPES, Layout(), Layout(tp_size=2))
    assert set(plan) == {(0, 0), (0, 1)}
    rank1 = {p.name.removeprefix(L0): p for p in plan[(0, 1)]}
    assert rank1["self_attn.q_proj.weight"] == Piece(L0 + "self_attn.q_proj.weight", 0, 4, 8, 4, 0)  # rows 4..8
    assert rank1["self_attn.k_proj.weight"] == Piece(L0 + "self_attn.k_proj.weight", 0, 2, 4, 2, 0)
    assert rank1["self_attn.o_proj.weight"] == Piece(L0 + "self_attn.o_proj.weight", 1, 4, 8, 4, 0)  # columns 4..8
    assert rank1["mlp.down_proj.weight"] == Piece(L0 + "mlp.down_proj.weight", 1, 4, 8, 4, 0)
    assert rank1["model.embed_tokens.weight"] == Piece("model.embed_tokens.weight", 0, 6, 12, 6, 0)
    assert rank1["input_layernorm.weight"] == Piece(L0 + "input_layernorm.weight", None, 0, 0, 0, 0)  # whole
    assert rank1["self_attn.q_proj.lora_A.default.weight"].dim is None
    assert rank1["self_attn.q_proj.lora_B.default.weight"] == Piece(L0 + "self_attn.q_proj.lora_B.default.weight",
                                                                     0, 4, 8, 4, 0)
    assert rank1["self_attn.o_proj.lora_A.default.weight"] == Piece(L0 + "self_attn.o_proj.lora_A.default.weight",
                                                                     1, 4, 8, 4, 0)
    assert rank1["self_attn.o_proj.lora_B.default.weight"].dim is None
    assert [p.name for p in plan[(0, 0)]] == sorted(SHAPES)  # every tensor, once, per rank


def test_a_tp2_trainer_feeds_tp1_and_tp4_engines_from_both_ranks():
    q = L0 + "self_attn.q_proj.weight"
    gather = transfer_plan(SHAPES, Layout(tp_size=2), Layout())  # one engine holding whole tensors
    assert [p for p in gather[(0, 0)] if p.name == q] == [Piece(q, 0, 0, 4, 0, 0)]
    assert [p for p in gather[(1, 0)] if p.name == q] == [Piece(q, 0, 4, 8, 0, 4)]  # lands at row 4
    finer = transfer_plan(SHAPES, Layout(tp_size=2), Layout(tp_size=4))
    assert [p for p in finer[(0, 1)] if p.name == q] == [Piece(q, 0, 2, 4, 2, 0)]  # rows 2..4 of sender rank 0
    assert [p for p in finer[(1, 2)] if p.name == q] == [Piece(q, 0, 4, 6, 0, 0)]
    assert not any(p.name == q for p in finer.get((0, 2), []))  # sender rank 0 holds nothing of rank 2's q
    # a replicated tensor comes from one sender rank, spread round-robin over the receivers
    norm = L0 + "input_layernorm.weight"
    assert {target: source for (source, target), pieces in finer.items()
            if any(p.name == norm for p in pieces)} == {0: 0, 1: 1, 2: 0, 3: 1}


@pytest.mark.parametrize("sender,receiver", [(Layout(), Layout(tp_size=2, replicas=2)), (Layout(tp_size=2), Layout()),
                                             (Layout(tp_size=2, replicas=2), Layout(tp_size=4))])
def test_the_plan_rebuilds_every_receiver_rank_exactly(sender, receiver):
    full = {name: torch.randn(shape) for name, shape in SHAPES.items()}

    def held(name, layout, rank):  # what a rank of a layout holds: torch.chunk along the split dim
        dim = split_dim(name)
        return full[name] if dim is None or layout.tp_size == 1 else full[name].chunk(layout.tp_size, dim)[layout.tp_rank(rank)]

    plan = transfer_plan(SHAPES, sender, receiver)
    for target in range(receiver.size):
        built = {name: torch.full(local_shape(shape, name, receiver, target), float("nan")) for name, shape in SHAPES.items()}
        for (source, to), pieces in plan.items():
            for p in (p for p in pieces if to == target):
                src, dst = held(p.name, sender, source), built[p.name]
                if p.dim is None:
                    dst.copy_(src)
                else:
                    width = p.stop - p.start
                    dst.narrow(p.dim, p.target_start, width).copy_(src.narrow(p.dim, p.source_start, width))
        assert all(torch.equal(built[n], held(n, receiver, target)) for n in SHAPES)


needs_ucxx = pytest.mark.skipif(not p2p.ucxx_available(), reason="ucxx-cu12 is not installed (the p2p extra)")


@needs_ucxx
def test_publish_over_ucxx_delivers_a_tiny_model_to_two_engine_processes(cfg):
    tensors = tiny_model_tensors()
    cfg = cfg.with_overrides(weights={"transport": "p2p", "bucket_mb": 1}, rollout={"num_workers": 2})
    sender = p2p.P2PSender(cfg, timeout_s=TIMEOUT_S)
    procs, results = start_engines(p2p.P2PReceiver, cfg, [("worker-0", {}), ("worker-1", {})], want=2)
    producer = RecordProducer(cfg.broker)
    first = sender.publish(producer, 1, 1, tensors)
    tensors["model.norm.weight"] += 1
    second = sender.publish(producer, 2, 2, tensors)
    sender.close()
    got = outcomes(procs, results, 4)
    assert [(label, v, status) for label, v, status, _ in got] == [
        (label, v, "ok") for label in ("worker-0/0", "worker-1/0") for v in (1, 2)]
    for _, version, _, (got_names, sums, _) in got:
        record = first if version == 1 else second
        assert (got_names, sums) == (record.tensor_names, record.checksums)
    assert first.location.startswith("ucx://") and first.checksums != second.checksums


def deliver_to_tp2_engine(use_ucxx: bool, corrupt=None):
    """One engine of two tensor-parallel ranks (two processes) gets version 1 of the tiny model."""
    cfg = Config().with_overrides(weights={"bucket_mb": 1})
    tensors = tiny_model_tensors()
    sender = p2p.P2PSender(cfg, num_engines=1, tp_size=2, timeout_s=TIMEOUT_S, use_ucxx=use_ucxx)
    record, staged = sender.prepare(1, 1, tensors)
    if corrupt is not None:
        corrupt(staged)
    engines = [("worker-0", {"tp_rank": rank, "tp_size": 2}) for rank in (0, 1)]
    procs, results = start_engines(p2p.P2PReceiver, cfg, engines, [record])
    sender.deliver(1, staged)
    sender.close()
    return tensors, record, outcomes(procs, results, 2)


def expected_shard(tensors, name: str, rank: int) -> torch.Tensor:
    dim = split_dim(name)
    return tensors[name] if dim is None else tensors[name].chunk(2, dim)[rank]


@pytest.mark.parametrize("use_ucxx", [pytest.param(True, marks=needs_ucxx), False], ids=["ucxx", "torch-fallback"])
def test_each_rank_of_a_tp2_engine_gets_only_its_shards(use_ucxx):
    tensors, record, got = deliver_to_tp2_engine(use_ucxx)
    assert record.location.startswith("ucx://" if use_ucxx else "tcp://")
    for rank, (label, version, status, (got_names, sums, shapes)) in enumerate(got):
        assert (label, version, status, got_names) == (f"worker-0/{rank}", 1, "ok", record.tensor_names)
        assert sums == [checksum(expected_shard(tensors, n, rank)) for n in got_names]
        q = got_names.index("model.layers.0.self_attn.q_proj.weight")
        o = got_names.index("model.layers.0.self_attn.o_proj.weight")
        assert (shapes[q], shapes[o]) == ((32, 64), (64, 32))  # rows / columns halved


def test_the_fallback_is_chosen_where_ucxx_is_absent(monkeypatch):
    monkeypatch.setattr(p2p, "ucxx_available", lambda: False)
    sender = p2p.P2PSender(Config(), num_engines=1, timeout_s=5)
    assert isinstance(sender.server, p2p.TorchServer) and sender.location.startswith("tcp://")
    sender.close()


def test_a_byte_corrupted_in_a_bucket_is_caught_by_the_receiving_rank():
    def corrupt(staged):  # flip one byte of rank 1's q_proj shard after the sender took its checksum
        piece = staged[1].pieces["model.layers.0.self_attn.q_proj.weight"]
        piece.view(-1)[:1].view(torch.uint8)[0] ^= 0xFF  # the view shares memory with the sender's tensor

    _, _, got = deliver_to_tp2_engine(p2p.ucxx_available(), corrupt)
    assert [status for _, _, status, _ in got] == ["ok", "rejected"]
    assert "checksum mismatch on 1" in got[1][3] and "q_proj" in got[1][3]


@pytest.mark.parametrize("use_ucxx,message", [pytest.param(True, r"receivers \[0\] did not fetch it within 2s",
                                                           marks=needs_ucxx),
                                              (False, "could not connect to all ranks within 2s")],
                         ids=["ucxx", "torch-fallback"])
def test_a_missing_engine_is_a_clear_timeout(use_ucxx, message):
    sender = p2p.P2PSender(Config(), num_engines=1, timeout_s=2.0, use_ucxx=use_ucxx)
    _, staged = sender.prepare(1, 1, {"model.norm.weight": torch.ones(4)})
    with pytest.raises(p2p.WeightTransferError, match=message):
        sender.deliver(1, staged)
    sender.close()
