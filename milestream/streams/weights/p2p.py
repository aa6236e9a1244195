"""P2P transport: the trainer's exporting rank writes each engine rank only the tensors, or the
tensor-parallel shards, that rank holds (plan.py), instead of the whole model to everyone.

Receivers are ``weights.num_engines`` engines (``rollout.num_workers`` by default) of ``tp_size``
ranks each; receiver index = engine index * tp_size + tp rank. Per version the sender announces the
record, then serves every receiver once: a header (the bucket manifest of that receiver's pieces,
with a checksum per piece, and each piece's slice of the full tensor) and then its buckets, packed
into one staging buffer of two bucket-sized slots (one is packed while the other is on the wire),
reused for every target, bucket and version (UCX registers a buffer on first use and keeps the
registration in its cache, so reuse means registering once).

Over ucxx when it is installed (``ucx://HOST:PORT/...``): the sender listens, each receiver keeps
one endpoint open and asks for a version; with ucxx absent, over torch.distributed send/recv in a
gloo group like the broadcast's (``tcp://HOST:PORT/...``). A receiver verifies the checksum of every
piece it assembles, and with whole tensors (tp_size 1) the record's per-tensor checksums as well.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import WeightVerificationError, checksum, checksums
from milestream.streams.weights.broadcast import (DEFAULT_TIMEOUT_S, Rendezvous, WeightTransferError, engine_index,
                                                  finish, new_group, open_store)
from milestream.streams.weights.buckets import Manifest, pack_bucket, plan_buckets, unpack_bucket, verify_entries
from milestream.streams.weights.plan import Layout, transfer_plan

log = logging.getLogger(__name__)

_HELLO = 2  # int64s a receiver sends: (receiver index, version)
# The staging buffer holds this many buckets: one is packed while the one before it is on the wire.
SLOTS = 2


def ucxx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


@dataclass
class Payload:
    """What one receiver gets: its header and the pieces its buckets are packed from."""

    header: bytes
    manifest: Manifest
    pieces: dict[str, Tensor]  # views of the sender's tensors, possibly strided


def payloads(tensors: Mapping[str, Tensor], version: int, receivers: Layout, bucket_mb: int,
             digests: dict[tuple, str] | None = None) -> dict[int, Payload]:
    """Every receiver's payload when one rank holds the full tensors (the trainer's export).

    ``digests`` caches checksums by (name, dim, start, stop): a slice that many receivers share (a
    whole tensor, one tensor-parallel rank's shard in every engine) is hashed once.
    """
    plan = transfer_plan({name: tuple(t.shape) for name, t in tensors.items()}, Layout(), receivers)
    digests = {} if digests is None else digests
    out = {}
    for target in range(receivers.size):
        pieces, slices, known = {}, {}, {}
        for piece in plan.get((0, target), []):
            whole = tensors[piece.name]
            view = whole if piece.dim is None else whole.narrow(piece.dim, piece.start, piece.stop - piece.start)
            key = (piece.name, piece.dim, piece.start, piece.stop)
            if key not in digests:
                digests[key] = checksum(view)
            pieces[piece.name], known[piece.name] = view, digests[key]
            slices[piece.name] = [piece.dim, piece.start, piece.stop]
        manifest = plan_buckets(pieces, version, bucket_mb, known)
        header = json.dumps({"manifest": manifest.to_bytes().decode(), "slices": slices, "tp_size": receivers.tp_size,
                             "error": ""}).encode()
        out[target] = Payload(header, manifest, pieces)
    return out


def error_header(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


# ---- ucxx -----------------------------------------------------------------------------------------

class _LoopThread:
    """ucxx listeners and endpoints belong to the asyncio loop that made them: this process runs all of
    them on one daemon thread, and the synchronous halves below submit coroutines to it."""

    _instance: "_LoopThread | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ucxx-loop", daemon=True).start()

    @classmethod
    def get(cls) -> "_LoopThread":
        with cls._lock:
            if cls._instance is None:
                os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a variable UCX itself ignores
                cls._instance = cls()
            return cls._instance

    def run(self, coro, timeout_s: float | None = None):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()  # do not leave it running on the loop against a connection given up on
            raise


class UcxxServer:
    """The sender's listener. ``serve`` hands out one version to every receiver and waits for them all."""

    def __init__(self, port: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.threads = _LoopThread.get()
        self._current: tuple[int, dict[int, Payload], set[int]] | None = None  # version, payloads, pending
        self._staging = np.empty(0, dtype=np.uint8)
        self._slot_bytes = 0
        self.listener = self.threads.run(self._listen(port), timeout_s)  # also makes the loop's primitives
        self.port = self.listener.port

    async def _listen(self, port: int):
        import ucxx

        # one sender on the wire at a time: on loopback TCP two concurrent streams were slower than one
        self._changed, self._wire = asyncio.Condition(), asyncio.Lock()
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(SLOTS):
            self._free_slots.put_nowait(slot)
        return ucxx.create_listener(self._handle, port)

    def serve(self, version: int, payloads: dict[int, Payload]) -> None:
        self.threads.run(self._serve(version, payloads), self.timeout_s + 30)

    async def _serve(self, version: int, payloads: dict[int, Payload]) -> None:
        # between versions nothing is in flight: the one buffer may grow here, and only here
        self._slot_bytes = max((size for p in payloads.values() for size in p.manifest.bucket_sizes), default=0)
        if self._staging.size < SLOTS * self._slot_bytes:
            self._staging = np.empty(SLOTS * self._slot_bytes, dtype=np.uint8)
        pending = set(payloads)
        async with self._changed:
            self._current = (version, payloads, pending)
            self._changed.notify_all()
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not pending), self.timeout_s)
            except TimeoutError:
                raise WeightTransferError(f"p2p version {version}: receivers {sorted(pending)} did not fetch it "
                                          f"within {self.timeout_s:.0f}s") from None
            finally:
                self._current = None

    async def _handle(self, endpoint) -> None:
        import ucxx.exceptions

        hello = np.empty(_HELLO, dtype=np.int64)
        try:
            while True:
                await endpoint.recv(hello)
                await self._answer(endpoint, int(hello[0]), int(hello[1]))
        except ucxx.exceptions.UCXError:
            return  # the receiver closed its endpoint (engine shut down or restarted)
        except Exception:  # a task's exception would otherwise vanish and the version time out unexplained
            log.exception("p2p sender: serving a receiver failed")
            raise

    async def _answer(self, endpoint, target: int, version: int) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self._current is not None and self._current[0] >= version), self.timeout_s)
            except TimeoutError:
                await _send_header(endpoint, error_header(f"the sender never staged version {version}"))
                return
            current_version, payloads, pending = self._current
        if current_version != version or target not in payloads:
            await _send_header(endpoint, error_header(f"receiver {target} asked for version {version}; the sender "
                                                      f"serves version {current_version} to {len(payloads)} receivers"))
            return
        await self._send_payload(endpoint, payloads[target])
        async with self._changed:
            pending.discard(target)
            self._changed.notify_all()

    async def _send_payload(self, endpoint, payload: Payload) -> None:
        await _send_header(endpoint, payload.header)
        for index in range(len(payload.manifest.bucket_sizes)):
            slot = await self._free_slots.get()
            try:
                start = slot * self._slot_bytes
                staging = torch.from_numpy(self._staging[start:start + self._slot_bytes])
                bucket = pack_bucket(payload.pieces, payload.manifest, index, staging)
                async with self._wire:
                    await endpoint.send(bucket.numpy())
            finally:
                self._free_slots.put_nowait(slot)

    def close(self) -> None:
        self.listener.close()


async def _send_header(endpoint, header: bytes) -> None:
    await endpoint.send(np.array([len(header)], dtype=np.int64))
    await endpoint.send(np.frombuffer(header, dtype=np.uint8).copy())


class UcxxClient:
    """A receiver's endpoint to the sender, opened on the first version and kept."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.threads = _LoopThread.get()
        self.endpoint = None

    def fetch(self, sender: Rendezvous, target: int, version: int) -> tuple[dict, list[Tensor]]:
        try:
            return self.threads.run(self._fetch(sender, target, version), self.timeout_s)
        except TimeoutError:
            self.endpoint = None  # half a message may be on it: the next version connects afresh
            raise WeightTransferError(f"p2p receiver {target}: version {version} did not arrive from {sender} "
                                      f"within {self.timeout_s:.0f}s") from None

    async def _fetch(self, sender: Rendezvous, target: int, version: int) -> tuple[dict, list[Tensor]]:
        import ucxx

        if self.endpoint is None:
            self.endpoint = await ucxx.create_endpoint(sender.host, sender.port)
        await self.endpoint.send(np.array([target, version], dtype=np.int64))
        length = np.empty(1, dtype=np.int64)
        await self.endpoint.recv(length)
        raw = np.empty(int(length[0]), dtype=np.uint8)
        await self.endpoint.recv(raw)
        header = json.loads(raw.tobytes())
        buckets = []
        for size in Manifest.from_bytes(header["manifest"].encode()).bucket_sizes if not header["error"] else []:
            bucket = np.empty(size, dtype=np.uint8)
            await self.endpoint.recv(bucket)
            buckets.append(torch.from_numpy(bucket))  # the tensors will be views of it: no copy
        return header, buckets

    def close(self) -> None:
        if self.endpoint is not None:
            self.threads.run(self.endpoint.close(), 10)
            self.endpoint = None


# ---- torch.distributed fallback -------------------------------------------------------------------

class TorchServer:
    """Sender rank 0 of a gloo group whose ranks 1..R are the receivers: send/recv instead of ucxx."""

    def __init__(self, host: str, port: int, receivers: int, timeout_s: float) -> None:
        self.host, self.receivers, self.timeout_s = host, receivers, timeout_s
        self.store = open_store(host, port, is_master=True, timeout_s=timeout_s)
        self.port = self.store.port
        self.group: dist.ProcessGroup | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)

    def serve(self, version: int, payloads: dict[int, Payload]) -> None:
        if self.group is None:
            self.group = new_group(self.store, "p2p", 0, self.receivers + 1, torch.device("cpu"), self.timeout_s,
                                   self.host)
        what = f"p2p send of version {version}"
        slot_bytes = max((size for p in payloads.values() for size in p.manifest.bucket_sizes), default=0)
        if self._staging.numel() < SLOTS * slot_bytes:
            self._staging = torch.empty(SLOTS * slot_bytes, dtype=torch.uint8)
        in_flight: list[dist.Work | None] = [None] * SLOTS
        sent = 0
        for target in sorted(payloads):
            payload, rank = payloads[target], target + 1
            header = torch.frombuffer(bytearray(payload.header), dtype=torch.uint8)
            finish(self.group.send([torch.tensor([header.numel()], dtype=torch.int64)], rank, 0), what)
            finish(self.group.send([header], rank, 0), what)
            for index in range(len(payload.manifest.bucket_sizes)):
                slot = sent % SLOTS
                sent += 1
                if in_flight[slot] is not None:  # that part of the buffer is still on the wire
                    finish(in_flight[slot], what)
                staging = self._staging[slot * slot_bytes:(slot + 1) * slot_bytes]
                in_flight[slot] = self.group.send([pack_bucket(payload.pieces, payload.manifest, index, staging)],
                                                  rank, 0)
        for work in in_flight:
            if work is not None:
                finish(work, what)

    def close(self) -> None:
        self.group = None


class TorchClient:
    """A receiver's rank (index + 1) in the sender's gloo group, joined on the first version."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None

    def fetch(self, sender: Rendezvous, target: int, version: int) -> tuple[dict, list[Tensor]]:
        if self.group is None:
            self._store = open_store(sender.host, sender.port, is_master=False, timeout_s=self.timeout_s)
            self.group = new_group(self._store, "p2p", target + 1, int(sender.params["receivers"]) + 1,
                                   torch.device("cpu"), self.timeout_s, sender.host)
        what = f"p2p receiver {target} fetching version {version}"
        length = torch.zeros(1, dtype=torch.int64)
        finish(self.group.recv([length], 0, 0), what)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        finish(self.group.recv([raw], 0, 0), what)
        header = json.loads(raw.numpy().tobytes())
        sizes = Manifest.from_bytes(header["manifest"].encode()).bucket_sizes if not header["error"] else ()
        buckets = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        for bucket in buckets:
            finish(self.group.recv([bucket], 0, 0), what)
        return header, buckets

    def close(self) -> None:
        self.group = None
        self._store = None


# ---- the two halves ---------------------------------------------------------------------------------

class P2PSender:
    """Trainer side (the exporting rank, which holds the full tensors)."""

    transport = "p2p"

    def __init__(self, cfg: Config, *, num_engines: int | None = None, tp_size: int = 1, host: str | None = None,
                 port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, use_ucxx: bool | None = None):
        self.bucket_mb = cfg.weights.bucket_mb
        host = host or cfg.weights.sender_host
        self.receivers = Layout(tp_size=tp_size,
                                replicas=cfg.rollout.num_workers if num_engines is None else num_engines)
        self.use_ucxx = ucxx_available() if use_ucxx is None else use_ucxx
        self.server = (UcxxServer(port, timeout_s) if self.use_ucxx
                       else TorchServer(host, port, self.receivers.size, timeout_s))
        params = {"receivers": str(self.receivers.size), "tp": str(tp_size)}
        self.location = str(Rendezvous("ucx" if self.use_ucxx else "tcp", host, self.server.port, params))

    def prepare(self, version: int, step: int, tensors: Mapping[str, Tensor]) -> tuple[WeightVersion, dict[int, Payload]]:
        """The record and every receiver's payload; pieces are views of ``tensors`` until delivered."""
        tensors = {name: t.detach().cpu() for name, t in tensors.items()}
        names, sums = checksums(tensors)
        staged = payloads(tensors, version, self.receivers, self.bucket_mb,
                          digests={(name, None, 0, 0): digest for name, digest in zip(names, sums)})
        record = WeightVersion(version=version, step=step, base_version=version - 1, transport=self.transport,
                               location=self.location, tensor_names=names, checksums=sums,
                               num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), ts=time.time())
        return record, staged

    def deliver(self, version: int, staged: dict[int, Payload]) -> None:
        """Write every receiver its payload; returns once all have it (raises WeightTransferError on a timeout)."""
        self.server.serve(version, staged)

    def publish(self, producer: RecordProducer, version: int, step: int,
                tensors: Mapping[str, Tensor]) -> WeightVersion:
        record, staged = self.prepare(version, step, tensors)
        producer.send(topics.WEIGHT_VERSIONS, [record])  # receivers ask for a version once they read it
        producer.flush()
        self.deliver(version, staged)
        return record

    def close(self) -> None:
        self.server.close()


class P2PReceiver:
    """Engine side: one per engine rank; returns whole tensors (tp_size 1) or this rank's shards."""

    every_version = True

    def __init__(self, cfg: Config, engine_id: str, *, tp_rank: int = 0, tp_size: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        del cfg  # the sender's address and layout come with each record
        self.engine_id, self.tp_rank, self.tp_size, self.timeout_s = engine_id, tp_rank, tp_size, timeout_s
        self.index = engine_index(engine_id) * tp_size + tp_rank
        self.client: UcxxClient | TorchClient | None = None
        self._location = ""
        self.shard_checksums: tuple[list[str], list[str]] = ([], [])  # what this rank holds, for its ack

    def receive(self, record: WeightVersion) -> dict[str, Tensor]:
        sender = Rendezvous.parse(record.location)
        if int(sender.params["tp"]) != self.tp_size:
            raise ValueError(f"engine {self.engine_id} runs tensor parallel {self.tp_size}; the sender plans for "
                             f"{sender.params['tp']}")
        if self.client is not None and self._location and record.location != self._location:
            self.close()  # a restarted trainer announces a new address: connect to that one
        if self.client is None:
            self.client = UcxxClient(self.timeout_s) if sender.scheme == "ucx" else TorchClient(self.timeout_s)
        self._location = record.location
        header, buckets = self.client.fetch(sender, self.index, record.version)
        if header["error"]:
            raise WeightTransferError(f"engine {self.engine_id} rank {self.tp_rank}: {header['error']}")
        manifest = Manifest.from_bytes(header["manifest"].encode())
        tensors: dict[str, Tensor] = {}
        for index, bucket in enumerate(buckets):
            tensors.update(unpack_bucket(manifest, index, bucket))
        self._verify(record, manifest, tensors)
        self.shard_checksums = ([e.name for e in manifest.entries], [e.checksum for e in manifest.entries])
        return tensors

    def _verify(self, record: WeightVersion, manifest: Manifest, tensors: Mapping[str, Tensor]) -> None:
        if manifest.version != record.version or sorted(tensors) != list(record.tensor_names):
            missing = sorted(set(record.tensor_names) - set(tensors))
            raise WeightVerificationError(f"version {record.version}: engine {self.engine_id} got version "
                                          f"{manifest.version}, missing {missing[:5]}")
        verify_entries(manifest, tensors)  # every piece against the checksum the sender took of it
        if self.tp_size == 1:  # whole tensors: the pieces' checksums must be the record's
            announced = dict(zip(record.tensor_names, record.checksums))
            differing = [e.name for e in manifest.entries if announced[e.name] != e.checksum]
            if differing:
                raise WeightVerificationError(f"version {record.version}: checksum mismatch on {len(differing)} "
                                              f"tensors, e.g. {differing[:3]}")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
