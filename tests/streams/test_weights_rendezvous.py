"""The broadcast and p2p rendezvous (issue 31): the trainer's TCPStore listens on weights.sender_host alone,
and an announcement whose address is another host's is refused by the check every reader of
weights.versions runs (its record then goes to the dead-letter topic, naming the field)."""
from __future__ import annotations

import psutil
import pytest

from milestream.config import Config
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import WeightVersion
from milestream.streams.versions import check_version
from milestream.streams.weights.broadcast import open_store

CHECKSUM = "0123456789abcdef"


def _listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_rendezvous_store_listens_on_the_sender_host_only() -> None:
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=10)
    assert _listening_addresses(store.port) == {"127.0.0.1"}


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_an_announcement_of_another_address_is_refused(transport: str) -> None:
    cfg = Config().with_overrides(weights={"transport": transport, "sender_host": "trainer-0.cluster"})
    at = Position(topics.WEIGHT_VERSIONS.name, 0, 7)

    def announced(location: str) -> WeightVersion:
        return WeightVersion(version=1, step=1, base_version=0, transport=transport, location=location,
                             tensor_names=["w"], checksums=[CHECKSUM], num_bytes=4, ts=1.0)

    check_version(cfg, announced("tcp://trainer-0.cluster:29500/world=3"), at, 1)
    check_version(cfg, announced("ucx://Trainer-0.Cluster:29500/receivers=2,tp=1"), at, 1)
    for location in ("tcp://attacker.example:29500/world=3", "tcp://127.0.0.1:29500/world=3", "tcp://[::1/world=3",
                     "garbage"):
        with pytest.raises(RecordError) as refused:
            check_version(cfg, announced(location), at, 1)
        assert refused.value.field == "location" and "weights.sender_host" in str(refused.value)
        assert f"{topics.WEIGHT_VERSIONS.name}[0]@7" in str(refused.value)
