"""``milestream track`` with TensorBoard, W&B (offline) and MLflow on, over real records on the broker: the
stage SIGKILLed where it has written points but not saved its position (a hold point), started again, then
given a step more: each store, read back with its own reader, holds every step once with the published
figures, the Prometheus endpoint's drop and weight figures, the evaluations and the configuration."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from milestream_testkit.chaos import sigkill
from holds import Holds
from metrics_records import METRICS_RECORDS, STEPS, publish_run, trainer_step
from tracker_stores import every_store, mlflow_points

from milestream.infra.kafka import RecordProducer
from milestream.infra.services import terminate
from milestream.observe.track import run_identity
from milestream.schemas import topics
from milestream.schemas.records import EvalResult

WRITERS = {"tensorboard": True, "wandb": "offline", "mlflow_uri": "local", "commit_s": 0.2}
# publish_run's messages (its metrics, 4 drops, 2 versions, 3 acks) and 2 evaluations
MESSAGES = METRICS_RECORDS + 4 + 2 + 3 + 2


def start_tracker(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "milestream.cli", "track", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT)


def alive(tracker: subprocess.Popen, log: Path):
    def check() -> None:
        assert tracker.poll() is None, log.read_text()
    return check


def saved(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Each writer's saved position: the last trainer step its store holds, and the messages it has read."""
    out = {}
    for path in (run_dir / "tracking").glob("*.json"):
        position = json.loads(path.read_text())
        out[path.name.split("-")[0]] = position["written"]["step"], sum(o for _, _, o in position["offsets"])
    return out


def wait_saved(run_dir: Path, step: int, messages: int, tracker: subprocess.Popen, log: Path,
               timeout_s: float = 120) -> None:
    """Until every writer has saved a position past trainer step ``step`` and every one of ``messages``."""
    deadline = time.monotonic() + timeout_s
    while not (len(steps := saved(run_dir)) == 3 and min(steps.values()) >= (step, messages)):
        alive(tracker, log)()
        assert time.monotonic() < deadline, f"timed out waiting for step {step} in every store: {steps}"
        time.sleep(0.2)


def test_trackers_write_each_step_once_across_a_kill_between_writing_and_saving(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(observe=WRITERS)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True)
    config, log = tmp_path / "config.yaml", tmp_path / "tracker.log"
    config.write_text(cfg.to_yaml())
    t0 = publish_run(cfg, bad_value=False)
    producer = RecordProducer(cfg.broker, client_id="trackers-test")
    for version, score in ((0, 0.25), (2, 0.5)):
        producer.send(topics.EVAL_RESULTS, [EvalResult("heldout", version, version, score, 0, "ok", "", t0 + version)])
    producer.flush()

    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("tracker.committing")
    tracker = start_tracker(config, log)
    try:
        held = holds.wait_held("tracker.committing", 120, alive(tracker, log))
        sigkill(held)  # its points are durable in its store; its position is not saved
        holds.release("tracker.committing", held)
        tracker.wait(30)
        tracker = start_tracker(config, log)
        wait_saved(run_dir, STEPS, MESSAGES, tracker, log)  # all read: step 5's row carries every figure
        producer.send(topics.METRICS, [trainer_step(STEPS + 1, t0 + 50)], key="trainer")
        producer.flush()
        wait_saved(run_dir, STEPS + 1, MESSAGES + 1, tracker, log)
    finally:
        terminate(tracker, grace=30)
    assert tracker.returncode == 0, log.read_text()[-3000:]

    for store, points in every_store(cfg).items():
        for step in range(1, STEPS + 2):  # step 2 was published twice: its first record wins, once
            expected = trainer_step(step, 0).values
            assert {k: points[f"trainer/{k}"][step] for k in expected} == {k: [v] for k, v in expected.items()}, store
        assert {s: len(v) for s, v in points["trainer/reward_mean"].items()} == {s: 1 for s in range(1, STEPS + 2)}
        last = STEPS + 1  # the Prometheus endpoint's figures (tests/observe/test_metrics_exporter.py)
        assert points["dropped/stale/processor"][last] == [2.0] and points["dropped/filtered"][last] == [1.0], store
        assert points["processor/queue_size"][last] == [3.0] and points["rollout/worker-0/samples_per_s"][last] == [3.2]
        assert points["verifier/weights_mismatched"][last] == [1.0]
        assert points["weights/version"][last] == [2.0] and points["weights/versions_published"][last] == [2.0]
        assert points["weights/applied_ok/worker-0"][last] == [2.0]
        assert points["weights/applied_failed/worker-1"][last] == [1.0]
        assert points["weights/engine_version/worker-0"][last] == [2.0]
        assert abs(points["weights/sync_seconds/worker-0"][last][0] - 0.5) < 1e-6
        assert points["trainer/trained_tokens"][last] == [(STEPS + 1) * 32 * 10.0]
        assert dict(points["eval/heldout"]) == {0: [0.25], 2: [0.5]}, store
    _, params = mlflow_points(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}", "milestream", run_identity(cfg)[1])
    assert params["trainer.batch_groups"] == str(cfg.trainer.batch_groups) and "redis.password" in params
    assert params["redis.password"] == "null"  # the configuration's secrets are never written


def test_wandb_transaction_log_reads_back_across_blocks_and_a_torn_tail(tmp_path):
    """Rows bigger than W&B's 32 KiB blocks come back whole, in order; a log cut short (a killed service)
    gives the rows before the cut."""
    from milestream.observe.sinks import WandbSink, wandb_logs, wandb_rows

    sink = WandbSink("offline", "milestream", None, tmp_path, "blocks", "blocks0", {"a": 1})
    rows = {step: {f"trainer/figure_{i:03d}_{'x' * 40}": step + i / 1000 for i in range(300)} for step in range(1, 9)}
    for step, values in rows.items():
        sink.row(step, 0.0, values)
    sink.commit()
    (path,) = wandb_logs(tmp_path, "blocks0")
    assert path.stat().st_size > 4 * 32 * 1024
    read = [r for r in wandb_rows(path)]
    assert [r["trainer_step"] for r in read] == list(rows)
    assert all({k: r[k] for k in rows[r["trainer_step"]]} == rows[r["trainer_step"]] for r in read)
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    assert [r["trainer_step"] for r in wandb_rows(cut)] == list(rows)[:len(list(wandb_rows(cut)))]
    assert 0 < len(list(wandb_rows(cut))) < len(rows)
    assert WandbSink("offline", "milestream", None, tmp_path, "blocks", "blocks0", {}).written().step == 8


def test_a_tracker_told_to_stop_while_it_starts_writes_every_step(cfg, tmp_path, monkeypatch):
    """The run ends while its restarted tracker is still opening its stores: the stage stops in order, reading
    the log to its end (its consumers have fetched nothing yet), and every store holds every step."""
    cfg = cfg.with_overrides(observe=WRITERS)
    Path(cfg.run.run_dir).mkdir(parents=True)
    config, log = tmp_path / "config.yaml", tmp_path / "tracker.log"
    config.write_text(cfg.to_yaml())
    publish_run(cfg, bad_value=False)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("tracker.opening")
    tracker = start_tracker(config, log)
    try:
        held = holds.wait_held("tracker.opening", 120, alive(tracker, log))
        tracker.terminate()
        holds.release("tracker.opening", held)
        tracker.wait(120)
    finally:
        terminate(tracker, grace=30)
    assert tracker.returncode == 0, log.read_text()[-3000:]
    for store, points in every_store(cfg).items():
        assert {s: len(v) for s, v in points["trainer/reward_mean"].items()} == {s: 1 for s in range(1, STEPS + 1)}, store
