"""Archives written straight to segments, without a broker or an archiver: for the log's readers."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from milestream.log.archive import ROW_SCHEMA, archive_dir
from milestream.schemas import topics
from milestream.schemas.codec import encode
from milestream.schemas.records import Record


def write_archive(run_dir, messages: dict[topics.TopicSpec, list[Record | bytes]]) -> None:
    """One segment per topic, every message on partition 0 at offsets 0, 1, ... (raw bytes as given), under
    the manifest the archiver writes first."""
    archive_dir(run_dir).mkdir(parents=True)
    (archive_dir(run_dir) / "manifest.json").write_text(json.dumps({"topic_prefix": "", "topics": {
        spec.name: {"partitions": 1, "max_message_bytes": spec.max_message_mb * 1024 * 1024}
        for spec in topics.CATALOGUE}}))
    for spec, values in messages.items():
        folder = archive_dir(run_dir) / spec.name
        folder.mkdir(parents=True)
        rows = [{"topic": spec.name, "partition": 0, "offset": offset, "timestamp_ms": 1000 + offset,
                 "timestamp_type": 1, "key": None, "schema_id": None, "headers": None,
                 "value": value if isinstance(value, bytes) else encode([value])}
                for offset, value in enumerate(values)]
        pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), folder / "000000000000.parquet")
