"""Offline debugging of a logged run: selection by step, group, time and offset; the Parquet export
read back and queried; one trajectory printed; the processor and the trainer re-driven offline.

The run is built once for the module from real parts: rollout records with real token ids are
published to the broker, the real stream processor (its own process) joins and drops them, the real
learner trains two steps on the emitted groups and their step records are published as the trainer
does, and the real archiver writes everything to RUN_DIR/archive.
"""
from __future__ import annotations

import io
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from streams.synthetic import ProcessorProcess, admit, topic_reader, wait_until

from milestream.cli import main
from milestream.config import Config
from milestream.log.archive import Archiver
from milestream.observe.selection import (SAMPLE_SCHEMA, OffsetRange, Selection, SelectionError, export_parquet,
                                          parse_time, sample_table)
from milestream.train.learner import CollectedGroup, Learner
from milestream.log.reader import ArchiveSource, BrokerSource
from milestream.log.samples import logged_samples
from milestream.observe.redrive import redrive_processor, redrive_trainer
from milestream.observe.show import print_trajectories
from milestream.infra.kafka import Admin, RawMessage, RecordProducer, produce_raw, topic_name
from milestream.infra.model import configure_process, load_tokenizer
from milestream.schemas import topics
from milestream.schemas.codec import RecordError
from milestream.schemas.records import GroupSample, LogProbs, Metrics, Trajectory, WeightVersion
from milestream.streams.ledger import BufferLedger

G = 4
ANSWERS = {"add#0": ("3 + 4", "7"), "sub#0": ("9 - 5", "4"), "mul#0": ("2 + 2", "4"),
           "abort#0": ("1 + 1", "2"), "stale#0": ("5 + 3", "8"), "partial#0": ("6 - 1", "5")}
FIRST_PHASE = ("add#0", "sub#0", "mul#0", "abort#0")  # before weight version 3 exists
STEPS = {1: ["add#0", "sub#0"], 2: ["mul#0"]}
_namespaces = itertools.count()


@dataclass(frozen=True)
class LoggedRun:
    cfg: Config
    decode_text: object
    second_phase_ms: int  # no first-phase record is stamped at or after this

    @property
    def archive(self) -> ArchiveSource:
        return ArchiveSource(self.cfg.run_path)

    def table(self, source=None):
        return sample_table(source or self.archive, self.decode_text)


def _rollout(tokenizer, group_id: str, version: int) -> list[tuple[topics.TopicSpec, object]]:
    question, answer = ANSWERS[group_id]
    prompt_ids = tokenizer.encode(f"<|im_start|>user\nWhat is {question}?<|im_end|>\n<|im_start|>assistant\n<answer>")
    out = []
    for i in range(G):
        text = f"{answer}</answer><|im_end|>" if i % 2 == 0 else f"{int(answer) + i} maybe<|im_end|>"
        ids = tokenizer.encode(text)
        status = "aborted" if group_id == "abort#0" and i == 1 else "completed"
        out.append((topics.TRAJECTORIES, Trajectory(
            f"{group_id}/{i}", group_id, group_id[:-2], i, G, prompt_ids, ids, [1] * (len(ids) - 1) + [0],
            [version] * len(ids), 1.1 if i % 2 == 0 else 0.0, status, text, "engine-0", "worker-0", 0.0, 0.0)))
        if group_id != "partial#0":  # its log-probs never arrive: it stays incomplete
            out.append((topics.LOGPROBS, LogProbs(f"{group_id}/{i}", group_id, i, G, [-0.25 * (k + 1) for k in range(len(ids))])))
    return out


def _publish(cfg: Config, records) -> None:
    producer = RecordProducer(cfg.broker, client_id="inspect-test")
    for spec, record in records:
        producer.send(spec, [record], key=record.group_id if hasattr(record, "group_id") else None)
    producer.flush()


def _drive_processor(cfg: Config, processor: ProcessorProcess, tokenizer) -> dict[str, list[GroupSample]]:
    """Phase 1 joined (one group aborted), then weight version 3 seen, then phase 2 (one group stale).
    Returns the emitted groups' samples."""
    metrics, groups, dropped = (topic_reader(cfg, spec) for spec in (topics.METRICS, topics.GROUPS, topics.DROPPED))
    seen: dict[str, list] = {"groups": [], "dropped": [], "versions": []}
    emitted: dict[str, list[GroupSample]] = {}

    def read() -> None:
        processor.assert_alive()
        for delivery in groups.drain(idle_s=0.2):
            seen["groups"].append(delivery.records[0].group_id)
            emitted[delivery.records[0].group_id] = delivery.records
        seen["dropped"] += [r.group_id for d in dropped.drain(idle_s=0.2) for r in d.records]
        seen["versions"] += [r.values.get("latest_version") for d in metrics.drain(idle_s=0.2) for r in d.records]
    try:
        admit(cfg, [*FIRST_PHASE, "stale#0", "partial#0"])
        _publish(cfg, [r for g in FIRST_PHASE for r in _rollout(tokenizer, g, 0)])
        wait_until(lambda: read() or len(seen["groups"]) + len(seen["dropped"]) == 4, 120, "phase 1 groups")
        location = str(cfg.run_path.resolve() / "weights" / "v000003.safetensors")  # announced only
        _publish(cfg, [(topics.WEIGHT_VERSIONS, WeightVersion(3, 3, 2, "disk", location, ["w"], ["0" * 16], 0,
                                                              time.time()))])
        wait_until(lambda: read() or 3.0 in seen["versions"], 120, "the processor to see version 3")
        _publish(cfg, [r for g in ("stale#0", "partial#0") for r in _rollout(tokenizer, g, 0)])
        wait_until(lambda: read() or "stale#0" in seen["dropped"], 120, "the stale group dropped")
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        for reader in (metrics, groups, dropped):
            reader.close()
    samples = logged_samples(BrokerSource(cfg, idle_s=1.0))  # the records each manifest points at, joined
    return {group_id: samples[group_id] for group_id in emitted}


def _train_and_log(cfg: Config, learner: Learner, emitted: dict[str, list[GroupSample]]) -> None:
    """Two real learner steps on the emitted groups, published as the trainer publishes its steps."""
    for step, group_ids in STEPS.items():
        figures = learner.train_step([CollectedGroup(g, emitted[g], 0) for g in group_ids])
        _publish(cfg, [(topics.METRICS, Metrics("trainer", step, time.time(), figures, group_ids, [0] * len(group_ids)))])


@pytest.fixture(scope="module")
def logged(live_services: Config, tmp_path_factory) -> LoggedRun:
    workdir = tmp_path_factory.mktemp("inspect")
    cfg = live_services.with_overrides(
        broker={"topic_prefix": f"inspect{os.getpid()}-{next(_namespaces)}."},
        model={"name": "tiny-random", "dtype": "float32"}, rollout={"group_size": G},
        trainer={"batch_groups": 2}, run={"run_dir": str(workdir / "run")},
        buffer={"capacity_factor": 4.0})  # credit for every group the test admits
    Admin(cfg.broker).create_topics()
    BufferLedger(cfg).initialise()
    processor = ProcessorProcess(cfg, workdir)
    processor.start()
    try:  # tokenizer and model load while the processor joins its consumer group
        tokenizer = load_tokenizer(cfg.model)
        configure_process(cfg.model)
        learner = Learner(cfg.with_overrides(trainer={"backend": "local"}))
        emitted = _drive_processor(cfg, processor, tokenizer)
    finally:
        processor.kill()  # everything it wrote was read back above; a clean stop only costs time
    _train_and_log(cfg, learner, emitted)
    stop = threading.Event()
    stop.set()  # just drain what is on the topics, then flush
    Archiver(cfg, flush_s=0.2, idle_s=1.0).run(stop)
    (cfg.run_path / "config.yaml").write_text(cfg.to_yaml())  # as `milestream run` leaves it
    table = sample_table(ArchiveSource(cfg.run_path), lambda ids: "")
    second = pc.min(table.filter(pc.is_in(table["group_id"], pa.array(["stale#0", "partial#0"])))["timestamp_ms"])
    return LoggedRun(cfg, lambda ids: tokenizer.decode(ids, skip_special_tokens=False), second.as_py())


def _groups(table) -> set[str]:
    return set(table["group_id"].to_pylist())


def test_every_sample_with_its_groups_fate(logged):
    table = logged.table()
    assert table.num_rows == G * len(ANSWERS)
    fates = {row["group_id"]: (row["outcome"], row["step"], row["drop_reason"], row["dropped_by"])
             for row in table.to_pylist()}
    assert fates == {"add#0": ("trained", 1, None, None), "sub#0": ("trained", 1, None, None),
                     "mul#0": ("trained", 2, None, None), "abort#0": ("dropped", None, "aborted", "processor"),
                     "stale#0": ("dropped", None, "stale", "processor"), "partial#0": ("pending", None, None, None)}
    partial = table.filter(pc.equal(table["group_id"], "partial#0"))
    assert partial["logprobs"].null_count == G


def test_selection_by_step_group_time_and_offset(logged):
    source = logged.archive
    table = logged.table()
    assert _groups(Selection(steps=(1, 1)).apply(table, source)) == {"add#0", "sub#0"}
    assert _groups(Selection(steps=(1, 2)).apply(table, source)) == {"add#0", "sub#0", "mul#0"}
    chosen = Selection(group_ids=frozenset({"stale#0"}), sample_index=2).apply(table, source)
    assert chosen["trajectory_id"].to_pylist() == ["stale#0/2"]

    before = Selection(until_ms=logged.second_phase_ms).apply(table, source)
    after = Selection(since_ms=logged.second_phase_ms).apply(table, source)
    assert _groups(before) == set(FIRST_PHASE) and _groups(after) == {"stale#0", "partial#0"}
    assert before.num_rows + after.num_rows == table.num_rows
    assert parse_time("1764553200.5") == 1764553200500 and parse_time("2025-12-01T01:40:00+00:00") == 1764553200000

    row = table.filter(pc.equal(table["trajectory_id"], "sub#0/3")).to_pylist()[0]
    on_trajectories = OffsetRange("rollout.trajectories", row["partition"], row["offset"], row["offset"])
    assert Selection(offsets=on_trajectories).apply(table, source)["trajectory_id"].to_pylist() == ["sub#0/3"]
    on_groups = OffsetRange("buffer.groups", row["group_partition"], row["group_offset"], row["group_offset"])
    assert _groups(Selection(offsets=on_groups).apply(table, source)) == {"sub#0"}
    step_records = OffsetRange("buffer.metrics", 0, 0, 10**9)  # the trainer's records name their groups
    assert _groups(Selection(offsets=step_records).apply(table, source)) == {"add#0", "sub#0", "mul#0"}
    with pytest.raises(SelectionError, match="weights.versions carries no group ids"):
        Selection(offsets=OffsetRange("weights.versions", 0, 0, 0)).apply(table, source)


def test_broker_and_archive_give_the_same_samples(logged):
    assert logged.table(BrokerSource(logged.cfg, idle_s=0.5)).equals(logged.table())


def test_parquet_export_read_back_and_queried(logged, tmp_path):
    path = export_parquet(logged.table(), tmp_path / "samples.parquet")
    assert pq.read_schema(path).names == SAMPLE_SCHEMA.names
    dropped = pq.read_table(path, columns=["group_id", "drop_reason"], filters=[("outcome", "=", "dropped")])
    assert set(zip(*dropped.to_pydict().values())) == {("abort#0", "aborted"), ("stale#0", "stale")}
    dataset = ds.dataset(path)
    rewarded = dataset.to_table(columns=["trajectory_id"], filter=(ds.field("step") == 1) & (ds.field("reward") > 1.0))
    assert sorted(rewarded["trajectory_id"].to_pylist()) == ["add#0/0", "add#0/2", "sub#0/0", "sub#0/2"]
    tokens = dataset.to_table(columns=["response_tokens", "logprobs", "loss_mask"],
                              filter=ds.field("trajectory_id") == "add#0/0").to_pylist()[0]
    assert "".join(tokens["response_tokens"]) == "7</answer><|im_end|>"
    assert len(tokens["logprobs"]) == len(tokens["loss_mask"]) == len(tokens["response_tokens"])


def test_trajectory_printed_with_decoded_text_and_token_rows(logged):
    row = logged.table().filter(pc.equal(logged.table()["trajectory_id"], "add#0/0")).to_pylist()[0]
    out = io.StringIO()
    print_trajectories([row], Console(file=out, width=120, color_system=None))
    text = out.getvalue()
    assert "What is 3 + 4?" in text and "7</answer><|im_end|>" in text
    assert "trained at step 1 (staleness 0)" in text and "reward    1.100" in text
    token_rows = [line for line in text.splitlines() if re.match(r"^│\s+\d+\s+│", line)]
    assert len(token_rows) == row["num_response_tokens"]
    for line, token, logprob, mask in zip(token_rows, row["response_tokens"], row["logprobs"], row["loss_mask"]):
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert cells[2] == repr(token) and float(cells[3]) == pytest.approx(logprob, abs=1e-4)
        assert int(cells[5]) == 0 and int(cells[6]) == mask


def test_replay_command_shows_a_dropped_trajectory(logged, capsys):
    code = main(["replay", "--run-dir", str(logged.cfg.run_path), "--group", "abort#0", "--sample", "1", "--show",
                 "--log-level", "WARNING"])
    assert code == 0
    assert "dropped by the processor: aborted (samples [1] aborted)" in capsys.readouterr().out


def test_replay_command_names_a_bad_selection(logged, capsys):
    code = main(["replay", "--run-dir", str(logged.cfg.run_path), "--topic", "weights.versions", "--offsets", "0:3",
                 "--log-level", "WARNING"])
    assert code == 2 and "weights.versions carries no group ids" in capsys.readouterr().err


@pytest.mark.parametrize("selection, said", [
    (["--group", "add#9", "--show"], "group add#9: none on the log (its group ids look like "),
    (["--steps", "999"], "step 999: none on the log (the trained steps are 1 to 2)"),
    (["--group", "add#0", "--steps", "2"], "each of step 2, group add#0 is met by some sample, no sample meets all"),
    (["--group", "add#0", "--sample", "7"], "sample 7: none on the log (its groups have 4 samples, indices from 0)"),
])
def test_replay_names_what_was_asked_for_when_the_log_has_none(logged, capsys, selection, said):
    code = main(["replay", "--run-dir", str(logged.cfg.run_path), *selection, "--log-level", "WARNING"])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert err.startswith(f"milestream replay: nothing selected from the {G * len(ANSWERS)} samples of the log: ")
    assert said in err, err


def test_track_from_archive_says_it_writes_into_the_old_run_folder(logged, tmp_path, capsys):
    run_dir = logged.cfg.run_path
    code = main(["track", "--from-archive", str(run_dir), "--tensorboard", str(tmp_path / "tb"),
                 "--log-level", "WARNING"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"writing the archived run {run_dir} into its folder: each writer's position under {run_dir / 'tracking'}" in out
    assert f"tensorboard: writing to {(tmp_path / 'tb').resolve()}" in out


def test_processor_redriven_offline_agrees_with_the_log(logged):
    report = redrive_processor(logged.cfg, logged.archive)
    assert report.agrees, report.summary()
    assert report.offline == {"add#0": "emitted", "sub#0": "emitted", "mul#0": "emitted", "abort#0": "aborted",
                              "stale#0": "stale", "partial#0": "partial"}
    strict = redrive_processor(logged.cfg.with_overrides(buffer={"max_staleness": 5}), logged.archive)
    assert strict.disagreements == [("stale#0", "emitted", "stale")]  # other rules: the difference is reported


def test_trainer_redriven_offline_bit_for_bit(logged):
    results = redrive_trainer(logged.cfg, logged.cfg.run_path, logged.archive, 1, 2)
    assert [(r.step, r.from_checkpoint) for r in results] == [(1, 0), (2, 0)]
    assert all(r.bitwise_equal for r in results), [(r.logged, r.replayed) for r in results]
    assert results[0].logged["loss"] != 0.0


def test_undecodable_record_is_named_by_topic_partition_offset_and_field(cfg):
    full, failures = topic_name(cfg.broker, topics.TRAJECTORIES), []
    raw = RecordProducer(cfg.broker)
    produce_raw(raw, full, RawMessage(full, 2, -1, 0, 0, b"g#0", None, b"not arrow"),
                lambda err, _offset: failures.append(err) if err is not None else None)
    raw.flush()
    assert not failures
    stop = threading.Event()
    stop.set()
    Archiver(cfg, flush_s=0.2, idle_s=1.0).run(stop)
    with pytest.raises(RecordError, match=r"rollout\.trajectories\[2\]@0: field '<value>': not an Arrow IPC"):
        sample_table(ArchiveSource(cfg.run_path), str)
