import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import zstandard

from milestream.schemas import routing, topics
from milestream.schemas.codec import Position, RecordError, decode, decode_table, encode, schema_with_id
from milestream.schemas.records import GroupManifest, LogProbs, Metrics, Record, Routing, Trajectory

POS = Position("rollout.trajectories", 2, 17)


def trajectory(i: int = 0, **changes) -> Trajectory:
    fields = dict(trajectory_id=f"g/{i}", group_id="g", prompt_id="p", sample_index=i, group_size=2,
                  prompt_ids=[1, 2, 3], response_ids=[4, 5], loss_mask=[1, 1], token_versions=[3, 4],
                  reward=1.0, status="completed", response_text="5</answer>", engine_id="e", worker_id="w",
                  submitted_at=1.0, finished_at=2.0)
    return Trajectory(**{**fields, **changes})


def test_every_topic_round_trips_its_record_type():
    assert {spec.record for spec in topics.CATALOGUE} >= {Trajectory, LogProbs, GroupManifest, Metrics}
    for spec in topics.CATALOGUE:
        assert issubclass(spec.record, Record)
        assert spec.record.SCHEMA.names == [f.name for f in dataclasses.fields(spec.record)]


def test_round_trip_keeps_values_and_order():
    records = [trajectory(0), trajectory(1, status="aborted", token_versions=[7, 8])]
    assert decode(encode(records), Trajectory, POS) == records
    metrics = Metrics("trainer", 3, 1.5, {"reward_mean": 0.25}, ["g1"], [1])
    assert decode(encode([metrics]), Metrics) == [metrics]


def test_value_is_one_zstd_frame_of_arrow_ipc_with_schema_id():
    table = pa.ipc.open_stream(zstandard.ZstdDecompressor().decompress(encode([trajectory()]))).read_all()
    assert table.schema.metadata[b"milestream.schema"] == Trajectory.schema_id().encode()


def test_routing_bytes_compressed_already_go_as_plain_ipc_and_are_read_in_place():
    (chunk,) = routing.pack("g/0", "g", 0, 1, np.zeros((4, 2, 2), dtype=int), num_experts=8)
    value = encode([chunk])
    table = pa.ipc.open_stream(value).read_all()  # no frame around it
    assert table.column("data")[0].as_py() == chunk.data and decode(value, Routing) == [chunk]


def test_a_value_of_the_first_layout_still_decodes_and_columns_are_read_alone():
    """Values written before one zstd frame wrapped the stream: Arrow's own per-buffer compression."""
    records = [trajectory(0), trajectory(1)]
    sink = pa.BufferOutputStream()
    batch = pa.RecordBatch.from_pylist([r.to_row() for r in records], schema=schema_with_id(Trajectory))
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    assert decode(sink.getvalue().to_pybytes(), Trajectory, POS) == records
    table = decode_table(encode(records), Trajectory, POS, columns=["group_id", "reward"])
    assert table.column_names == ["group_id", "reward"] and table.column("reward").to_pylist() == [1.0, 1.0]


def test_a_frame_that_inflates_past_its_bound_is_refused_unread():
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 * 1024 * 1024))
    with pytest.raises(RecordError, match="declares") as err:
        decode(bomb, Trajectory, POS)
    assert err.value.field == "<value>"


def test_garbage_names_topic_partition_offset():
    with pytest.raises(RecordError) as err:
        decode(b"\x00garbage", Trajectory, POS)
    assert "rollout.trajectories[2]@17" in str(err.value) and err.value.field == "<value>"


def test_wrong_schema_version_is_refused():
    schema = schema_with_id(Trajectory).with_metadata({b"milestream.schema": b"Trajectory/99"})
    batch = pa.RecordBatch.from_pylist([trajectory().to_row()], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(RecordError, match="Trajectory/99") as err:
        decode(sink.getvalue().to_pybytes(), Trajectory, POS)
    assert err.value.field == "<schema>"


def test_wrong_record_type_names_the_missing_field():
    value = encode([LogProbs("g/0", "g", 0, 2, [-0.5])])
    with pytest.raises(RecordError):
        decode(value, Trajectory, POS)


def test_field_of_wrong_type_is_named():
    schema = Trajectory.SCHEMA.set(Trajectory.SCHEMA.get_field_index("reward"), pa.field("reward", pa.string()))
    schema = schema.with_metadata({b"milestream.schema": Trajectory.schema_id().encode()})
    row = {**trajectory().to_row(), "reward": "high"}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist([row], schema=schema))
    with pytest.raises(RecordError) as err:
        decode(sink.getvalue().to_pybytes(), Trajectory, POS)
    assert err.value.field == "reward"


def test_a_value_of_an_older_version_decodes_with_the_added_fields_defaulted():
    """A run archived before Trajectory/2 (which added reward_error) still resumes."""
    old = pa.schema([f for f in Trajectory.SCHEMA if f.name != "reward_error"],
                    metadata={b"milestream.schema": b"Trajectory/1"})
    row = {k: v for k, v in trajectory(routing_chunks=1).to_row().items() if k != "reward_error"}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist([row], schema=old))
    (decoded,) = decode(sink.getvalue().to_pybytes(), Trajectory, POS)
    assert decoded == trajectory(routing_chunks=1) and decoded.reward_error == ""
