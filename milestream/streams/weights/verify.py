"""Verified weight delivery: the start-up noise check and the verifier consumer.

  noise check  (weights.noise_check) before the first version an engine's trainable weights are
               filled with noise; after that version is applied, every tensor the engine holds is
               compared with the delivered one. A tensor the update path skipped is still noise,
               so a delivery that silently misses part of the model cannot pass.
  acks         every applied version is acknowledged on weights.applied with the checksums the
               engine holds (base.acknowledge, called by the rollout worker).
  verifier     ``milestream verify-weights``: reads weights.versions and weights.applied, and flags
               every ack that names an unknown version, misses a tensor or differs in a checksum,
               or that reports a refused version, with a log line, a dead letter naming the ack's
               position and the Metrics record {source "verifier": weights_verified,
               weights_mismatched} on buffer.metrics. A record of either topic that does not decode,
               or that no trainer or engine writes (base.check_version, base.check_applied), is
               dead-lettered and never judged.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Mapping

from milestream.config import Config
from milestream.infra.kafka import Delivery, RecordConsumer, RecordProducer
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Metrics, WeightApplied, WeightVersion
from milestream.streams.ledger import BufferLedger
from milestream.streams.versions import check_applied, version_check
from milestream.streams.weights.base import WeightVerificationError, checksum, checksum_mismatches

if TYPE_CHECKING:  # the verifier stage runs without torch; the noise check runs in engines, which have it
    from torch import Tensor, nn

log = logging.getLogger(__name__)


# ---- the start-up noise check ----------------------------------------------------------------------

class NoiseCheck:
    """Noise into an engine's model before its first version; a comparison after that version."""

    def __init__(self, model: nn.Module, seed: int = 0):
        self.model, self.seed = model, seed
        self.pending = True  # until the first version passed

    def fill(self) -> None:
        """Call while the engine is paused (or before it generates): parameters change in place."""
        import torch

        from milestream.infra.model import trainable_state_dict  # transformers: engines have it loaded already

        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for tensor in trainable_state_dict(self.model).values():
                tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))

    def compare(self, version: int, delivered: Mapping[str, Tensor]) -> None:
        """Raise unless the model holds exactly ``delivered`` (cast to the engine's dtypes)."""
        bad = held_mismatches(self.model, delivered)
        if bad:
            raise WeightVerificationError(f"noise check: after version {version} the engine still holds "
                                          f"{len(bad)} tensors that differ from it, e.g. {bad[:3]}")
        self.pending = False


def held_mismatches(model: nn.Module, delivered: Mapping[str, Tensor]) -> list[str]:
    """Names of the trainable tensors the model does not hold bit for bit as ``delivered``."""
    from milestream.infra.model import trainable_state_dict

    held = trainable_state_dict(model)
    unmatched = sorted(held.keys() ^ delivered.keys())
    return unmatched + [name for name in sorted(held.keys() & delivered.keys())
                        if checksum(held[name]) != checksum(delivered[name].to(held[name].dtype))]


# ---- the verifier consumer -------------------------------------------------------------------------

class WeightVerifier:
    """Audits each ack on weights.applied against the version announced on weights.versions."""

    def __init__(self, cfg: Config, group_id: str = "weights-verifier", unknown_grace_s: float = 10.0):
        self.ledger = BufferLedger(cfg)
        self.producer = RecordProducer(cfg.broker, client_id="weights-verifier")
        self.versions = RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, group_id, deadletter=self.producer,
                                       check=version_check(cfg, self.ledger)).assign(partitions=[0])
        self.acks = RecordConsumer(cfg.broker, topics.WEIGHTS_APPLIED, group_id, deadletter=self.producer,
                                   check=self._check_acks).assign(partitions=range(cfg.broker.partitions))
        self.unknown_grace_s = unknown_grace_s
        # every record of a version: a trainer step redone after a resume announces its version again
        self.known: dict[int, list[WeightVersion]] = {}
        self.waiting: list[tuple[WeightApplied, Delivery, float]] = []  # acks whose version has not been read yet
        self.verified = self.mismatched = 0

    def _check_acks(self, records: list[WeightApplied], position: Position) -> None:
        for record in records:
            check_applied(record, position)

    def poll(self, timeout: float = 0.5) -> list[tuple[WeightApplied, str | None]]:
        """Judge what arrived: (ack, problem or None) for each ack decided now."""
        delivery = self.acks.poll(timeout)
        arrived = [(ack, delivery, time.monotonic()) for ack in (delivery.records if delivery else [])]
        if not arrived and not self.waiting:
            return []
        # an ack is written after its version record, so reading the versions after the acks sees it
        for versions in self.versions.drain(idle_s=0.2, max_wait_s=5.0):
            for record in versions.records:
                self.known.setdefault(record.version, []).append(record)
        pending, self.waiting, judged = self.waiting + arrived, [], []
        for ack, came_in, seen in pending:
            if ack.version not in self.known and time.monotonic() - seen < self.unknown_grace_s:
                self.waiting.append((ack, came_in, seen))
                continue
            judged.append((ack, came_in, self.judge(ack)))
        if judged:
            self._account(judged)
        return [(ack, problem) for ack, _, problem in judged]

    def judge(self, ack: WeightApplied) -> str | None:
        """What is wrong with the ack, or None when it holds exactly an announced version."""
        records = self.known.get(ack.version)
        if not records:
            return f"acknowledges version {ack.version}, which weights.versions never announced"
        if not ack.ok:
            return f"refused version {ack.version}: {ack.detail}"
        problems = []
        for record in records:
            missing, unexpected, differing = checksum_mismatches(list(record.tensor_names), list(record.checksums),
                                                                  list(ack.tensor_names), list(ack.checksums))
            if not (missing or unexpected or differing):
                return None
            problems.append(f"missing tensors {missing[:3]} ({len(missing)}), unexpected {unexpected[:3]} "
                            f"({len(unexpected)}), checksum differs on {differing[:3]} ({len(differing)})")
        return f"holds version {ack.version} wrongly: {'; '.join(problems)}"

    def _account(self, judged: list[tuple[WeightApplied, Delivery, str | None]]) -> None:
        for ack, delivery, problem in judged:
            if problem is None:
                self.verified += 1
                continue
            self.mismatched += 1
            log.error("weight mismatch: engine %s %s (%s)", ack.engine_id, problem, delivery.position)
            field = "version" if ack.version not in self.known else "ok" if not ack.ok else "checksums"
            self.producer.dead_letter(delivery.position, RecordError(delivery.position, field, problem),
                                      delivery.key, delivery.value)
        values = {"weights_verified": float(self.verified), "weights_mismatched": float(self.mismatched)}
        record = Metrics("verifier", self.verified + self.mismatched, time.time(), values)
        self.producer.send(topics.METRICS, [record], key="verifier")
        self.producer.flush()

    def run(self, stop: threading.Event) -> None:
        log.info("verifying weights.applied against weights.versions")
        while not stop.is_set():
            self.poll(0.5)
        # stopping: an ack still waiting for its version is judged now, its version unknown to the end
        judged = [(ack, came_in, self.judge(ack)) for ack, came_in, _ in self.waiting]
        if judged:
            self._account(judged)
        self.close()

    def close(self) -> None:
        self.producer.flush()
        self.versions.close()
        self.acks.close()
