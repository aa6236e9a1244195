"""Reading the experiment trackers' stores back, each with its own reader: TensorBoard's EventAccumulator, W&B's
transaction logs (wandb's record types), MLflow's client. Every store comes back as key -> step -> the values
written at that step (a point written twice shows as two values)."""
from __future__ import annotations

import collections
from pathlib import Path

from milestream.config import Config
from milestream.observe.sinks import wandb_logs, wandb_rows
from milestream.observe.track import run_identity

Points = dict[str, dict[int, list[float]]]


def tensorboard_points(folder: Path) -> Points:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    out: Points = collections.defaultdict(lambda: collections.defaultdict(list))
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            out[tag][event.step].append(tensor_util.make_ndarray(event.tensor_proto).item())
    return out


def wandb_points(directory: Path, run_key: str) -> Points:
    out: Points = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in wandb_logs(directory, run_key):
        for row in wandb_rows(path):
            step = row.get("trainer_step", row.get("eval_step"))
            for key, value in row.items():
                if not key.startswith("_") and key not in ("trainer_step", "eval_step"):
                    out[key][step].append(value)
    return out


def mlflow_points(uri: str, experiment: str, run_key: str) -> tuple[Points, dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    (run,) = client.search_runs([experiment_id], f"tags.`milestream.run` = '{run_key}'")
    out: Points = collections.defaultdict(lambda: collections.defaultdict(list))
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            out[key][metric.step].append(metric.value)
    return out, run.data.params


def every_store(cfg: Config) -> dict[str, Points]:
    """The three stores of a run whose observe section has all three writers on, at their default places."""
    name, key = run_identity(cfg)
    run_dir = cfg.run_path.resolve()
    mlflow, _ = mlflow_points(f"sqlite:///{run_dir / 'mlflow.db'}", cfg.observe.mlflow_experiment, key)
    return {"tensorboard": tensorboard_points(run_dir / "tensorboard" / name),
            "wandb": wandb_points(run_dir, key), "mlflow": mlflow}
