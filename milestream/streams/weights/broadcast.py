"""Broadcast transport: one process group spanning the trainer's sending rank and every rollout engine.

Rank 0 is the trainer's exporting rank, ranks 1..N the engines (``worker-i`` is rank i + 1); the
world size N + 1 is fixed by ``rollout.num_workers`` (or ``num_engines``). The trainer runs a
``TCPStore`` server whose address travels in each ``WeightVersion.location``
(``tcp://HOST:PORT/world=N+1``); an engine joins the group on its first version.

The group is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a ``PrefixStore``)
rather than with ``dist.new_group``: the engines are not members of the trainer's default group
(FSDP2 / Megatron under torchrun), and ``new_group`` can only carve subgroups out of that one.

Per version: the record goes on ``weights.versions`` first, then the manifest (its length, then its
bytes) and the buckets are broadcast from rank 0, packed into two staging buffers that alternate so
that packing bucket i + 1 overlaps sending bucket i. Engines receive inside ``receive(record)`` into
buckets they allocate from the manifest and verify every tensor against the record's checksums.
Every engine must take part in every version (a collective), in order: ``every_version``.
"""
from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import WeightVerificationError, verify
from milestream.streams.weights.buckets import Manifest, empty_buckets, pack_bucket, plan_buckets, unpack_bucket

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
_GROUP_PREFIX = "milestream/weights"


class WeightTransferError(ConnectionError):
    """A peer did not join, or did not take part in a transfer, within the timeout.

    A ConnectionError (an OSError), so the rollout worker's handler acknowledges the version as
    failed on weights.applied and keeps running, as it does for an unreadable file."""


# ---- rendezvous and groups (shared with p2p's torch.distributed fallback) ---------------------------

@dataclass(frozen=True)
class Rendezvous:
    """``scheme://host:port/key=value,key=value``, the address carried in ``WeightVersion.location``."""

    scheme: str
    host: str
    port: int
    params: dict[str, str]

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/" + ",".join(f"{k}={v}" for k, v in self.params.items())

    @classmethod
    def parse(cls, location: str) -> "Rendezvous":
        match = re.fullmatch(r"(\w+)://([^:/]+):(\d+)/(.*)", location)
        if not match:
            raise ValueError(f"weight location {location!r} is not scheme://host:port/key=value,...")
        scheme, host, port, rest = match.groups()
        params = dict(item.split("=", 1) for item in rest.split(",") if item)
        return cls(scheme, host, int(port), params)


def engine_index(engine_id: str) -> int:
    """``worker-3`` -> 3: the engine's place in the group, from the id the orchestrator gives it."""
    match = re.search(r"(\d+)$", engine_id)
    if not match:
        raise ValueError(f"engine id {engine_id!r} does not end in its index (worker-0, worker-1, ...); "
                         "pass the rank explicitly")
    return int(match.group(1))


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def open_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: the server (``is_master``) listens on ``host``'s address alone (torch's own
    socket would listen on every interface, whatever the host); a client connects to it."""
    listen_fd = None
    if is_master:
        listening = _listening_socket(host, port)
        port, listen_fd = listening.getsockname()[1], listening.detach()  # the store owns the socket now
    try:
        return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=listen_fd)
    except (RuntimeError, TimeoutError) as exc:  # the store client retries connecting until the timeout
        raise WeightTransferError(f"no weight rendezvous at tcp://{host}:{port} after {timeout_s:.0f}s "
                                  f"(is the trainer running?): {exc}") from exc


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``'s address (weights.sender_host): engines on other machines reach only
    what that name resolves to here, so it must not resolve to loopback on a cluster."""
    bound = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        bound = socket.socket(family, kind, proto)
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind(address)
    except OSError as exc:
        if bound is not None:
            bound.close()
        raise WeightTransferError(f"the weight rendezvous cannot listen on {host}:{port} (weights.sender_host: "
                                  f"an address or name of this machine): {exc}") from exc
    return bound


def new_group(store: dist.Store, name: str, rank: int, world_size: int, device: torch.device,
              timeout_s: float, host: str) -> dist.ProcessGroup:
    """A process group of its own over ``store`` (gloo on CPU, NCCL on GPU); blocks until all ranks join."""
    prefixed = dist.PrefixStore(f"{_GROUP_PREFIX}/{name}", store)
    timeout = timedelta(seconds=timeout_s)
    try:
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # On one machine bind loopback: a container's hostname often resolves to nothing usable.
        # Across machines gloo's default device follows GLOO_SOCKET_IFNAME / the hostname.
        loopback = host in ("127.0.0.1", "localhost")
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                            else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    except (RuntimeError, TimeoutError) as exc:
        raise WeightTransferError(f"weight group {name!r}: rank {rank} of {world_size} could not connect to all "
                                  f"ranks within {timeout_s:.0f}s (does the engine count match?): {exc}") from exc


def finish(work: dist.Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo reports a peer that never showed up as a RuntimeError "Timed out..."
        raise WeightTransferError(f"{what} failed (a peer died or never took part): {exc}") from exc


def start_broadcast(group: dist.ProcessGroup, tensor: Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


# ---- the two halves ---------------------------------------------------------------------------------

class BroadcastSender:
    """Trainer side (the exporting rank): announce a version, then broadcast it bucket by bucket."""

    transport = "broadcast"

    def __init__(self, cfg: Config, *, num_engines: int | None = None, host: str | None = None, port: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, device: str | torch.device | None = None):
        self.bucket_mb = cfg.weights.bucket_mb
        self.world_size = (cfg.rollout.num_workers if num_engines is None else num_engines) + 1
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else default_device()
        self.host = host = host or cfg.weights.sender_host
        self.store = open_store(host, port, is_master=True, timeout_s=timeout_s)
        self.location = str(Rendezvous("tcp", host, self.store.port, {"world": str(self.world_size)}))
        self.group: dist.ProcessGroup | None = None
        self._staging: list[Tensor | None] = [None, None]

    def prepare(self, version: int, step: int, tensors: Mapping[str, Tensor]) -> tuple[WeightVersion, Manifest]:
        """The record and the bucket layout; nothing is copied yet."""
        manifest = plan_buckets(tensors, version, self.bucket_mb)
        record = WeightVersion(version=version, step=step, base_version=version - 1, transport=self.transport,
                               location=self.location, tensor_names=[e.name for e in manifest.entries],
                               checksums=[e.checksum for e in manifest.entries], num_bytes=manifest.tensor_bytes,
                               ts=time.time())
        return record, manifest

    def publish(self, producer: RecordProducer, version: int, step: int,
                tensors: Mapping[str, Tensor]) -> WeightVersion:
        tensors = {name: t.detach() for name, t in tensors.items()}
        record, manifest = self.prepare(version, step, tensors)
        # engines join the collective when they read the record, so it must be out before we send
        producer.send(topics.WEIGHT_VERSIONS, [record])
        producer.flush()
        self.send(manifest, tensors)
        return record

    def connect(self) -> dist.ProcessGroup:
        """The group, built on first use (blocks until every engine has joined)."""
        if self.group is None:
            log.info("waiting for %d engines to join the weight broadcast at %s", self.world_size - 1, self.location)
            self.group = new_group(self.store, "broadcast", 0, self.world_size, self.device, self.timeout_s, self.host)
        return self.group

    def send(self, manifest: Manifest, tensors: Mapping[str, Tensor]) -> None:
        """Broadcast the manifest, then every bucket (the bytes path, without Kafka)."""
        group = self.connect()
        what = f"broadcast of weight version {manifest.version}"
        header = torch.frombuffer(bytearray(manifest.to_bytes()), dtype=torch.uint8).to(self.device)
        finish(start_broadcast(group, torch.tensor([header.numel()], dtype=torch.int64, device=self.device)), what)
        finish(start_broadcast(group, header), what)
        pending: list[dist.Work | None] = [None, None]
        for index in range(len(manifest.bucket_sizes)):
            slot = index % 2
            if pending[slot] is not None:  # the buffer is still on the wire: wait before overwriting it
                finish(pending[slot], what)
            self._staging[slot] = self._grown(self._staging[slot], manifest.bucket_sizes[index])
            bucket = pack_bucket(tensors, manifest, index, self._staging[slot])
            pending[slot] = start_broadcast(group, bucket)
        for work in pending:
            if work is not None:
                finish(work, what)

    def _grown(self, staging: Tensor | None, size: int) -> Tensor:
        if staging is None or staging.numel() < size:
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        return staging

    def close(self) -> None:
        self.group = None  # gloo/NCCL tear their connections down with the object
        self._staging = [None, None]


class BroadcastReceiver:
    """Engine side: take part in each version's broadcast and return its verified tensors."""

    every_version = True

    def __init__(self, cfg: Config, engine_id: str, *, rank: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, device: str | torch.device | None = None):
        del cfg  # the group's shape comes with the record's location
        self.engine_id = engine_id
        self.rank = engine_index(engine_id) + 1 if rank is None else rank
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else default_device()
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._location = ""

    def connect(self, location: str) -> dist.ProcessGroup:
        if self.group is not None and location != self._location:
            self.close()  # a restarted trainer announces a new rendezvous: join that one
        if self.group is None:
            rendezvous = Rendezvous.parse(location)
            world_size = int(rendezvous.params["world"])
            if not 1 <= self.rank < world_size:
                raise ValueError(f"engine {self.engine_id} is rank {self.rank}, outside the weight broadcast group "
                                 f"of {world_size} (trainer + {world_size - 1} engines: check rollout.num_workers)")
            self._store = open_store(rendezvous.host, rendezvous.port, is_master=False, timeout_s=self.timeout_s)
            self.group = new_group(self._store, "broadcast", self.rank, world_size, self.device, self.timeout_s,
                                   rendezvous.host)
            self._location = location
        return self.group

    def receive(self, record: WeightVersion) -> dict[str, Tensor]:
        group = self.connect(record.location)
        while True:
            manifest, buckets = self._receive_broadcast(group)
            if manifest.version == record.version:
                break
            if manifest.version > record.version:
                raise WeightTransferError(f"engine {self.engine_id} asked for version {record.version} but the "
                                          f"trainer is already broadcasting {manifest.version}")
            # a version this engine skipped: it had to take part anyway; the newer one comes next
            log.warning("engine %s drained skipped weight version %d", self.engine_id, manifest.version)
        tensors: dict[str, Tensor] = {}
        for index, bucket in enumerate(buckets):
            tensors.update(unpack_bucket(manifest, index, bucket))
        if [e.name for e in manifest.entries] != list(record.tensor_names):
            raise WeightVerificationError(f"version {record.version}: the broadcast manifest names other tensors "
                                          "than the record")
        verify(record, tensors)
        return tensors

    def _receive_broadcast(self, group: dist.ProcessGroup) -> tuple[Manifest, list[Tensor]]:
        what = f"engine {self.engine_id} receiving a weight broadcast"
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        finish(start_broadcast(group, length), what)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        finish(start_broadcast(group, header), what)
        manifest = Manifest.from_bytes(header.cpu().numpy().tobytes())
        buckets = empty_buckets(manifest, self.device)
        works = [start_broadcast(group, bucket) for bucket in buckets]  # gloo queues them in order
        for work in works:
            finish(work, what)
        return manifest, buckets

    def close(self) -> None:
        self.group = None
        self._store = None
