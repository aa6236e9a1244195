"""Trainer checkpoint save and load: safetensors + JSON (train/checkpoint.py) against the pickle it replaced.

The learner's state after one AdamW step (weights or LoRA adapters, both moments and the step of
every trainable tensor), a trainer state with ``--seen-groups`` group ids, and the RNG states are
written and read back ``--repeats`` times each way, alternating, in the same process on the same
disk: ``checkpoint.save`` / ``checkpoint.load_latest`` (sha256 of the tensor file on both sides),
and the former format, one ``torch.save`` of it all read with ``torch.load`` (a pickle). Prints one
JSON line:

  model, lora_rank, tensors          what was checkpointed
  bytes / baseline_bytes             on disk: the folder's two files / checkpoint.pt
  save_s / baseline_save_s           median seconds to write
  load_s / baseline_load_s           median seconds to read back (from the page cache: just written)

    .venv/bin/python benchmarks/checkpoint_format.py [--model tiny-random] [--lora-rank 16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.train import checkpoint
from milestream.train.backends.local import LocalBackend


def learner_state(cfg: Config) -> dict:
    """The backend's state_dict after one step, so that AdamW holds its moments."""
    backend = LocalBackend(cfg)
    params = list(backend.params.values())
    backend.step([None], lambda _: (sum(p.float().square().sum() for p in params) * 1e-6, {}), 1.0)
    return backend.state_dict()


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def pickle_format(folder: Path, state: checkpoint.TrainerState, learner: dict) -> Path:
    """What checkpoint.save wrote before safetensors + JSON."""
    path = folder / "checkpoint.pt"
    torch.save({"backend": learner, "state": {"step": state.step, "version": state.version,
                                              "offsets": dict(state.offsets), "seen_groups": sorted(state.seen_groups)},
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}, path)
    return path


def measure(cfg: Config, repeats: int, seen_groups: int) -> dict:
    learner = learner_state(cfg)
    state = checkpoint.TrainerState(step=7, version=7, offsets={p: 1000 + p for p in range(4)},
                                    seen_groups={f"task-s42-e0-{i}#0" for i in range(seen_groups)})
    times: dict[str, list[float]] = {"save_s": [], "load_s": [], "baseline_save_s": [], "baseline_load_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, old = Path(tmp) / "run", Path(tmp) / "old"
        old.mkdir()
        for _ in range(repeats):
            times["save_s"].append(timed(lambda: checkpoint.save(run_dir, state, learner)))
            times["load_s"].append(timed(lambda: checkpoint.load_latest(run_dir)))
            times["baseline_save_s"].append(timed(lambda: pickle_format(old, state, learner)))
            # the baseline reads its own file, just written: the unpickling the new format removes
            times["baseline_load_s"].append(timed(lambda: torch.load(old / "checkpoint.pt", weights_only=False)))
        folder = checkpoint.saved(run_dir)[state.step]
        sizes = sum(f.stat().st_size for f in folder.iterdir()), (old / "checkpoint.pt").stat().st_size
    return {"model": cfg.model.name, "lora_rank": cfg.model.lora_rank, "tensors": len(learner["model"]),
            "bytes": sizes[0], "baseline_bytes": sizes[1],
            **{key: round(statistics.median(values), 4) for key, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seen-groups", type=int, default=10_000)
    args = parser.parse_args()
    cfg = Config().with_overrides(model={"name": args.model, "lora_rank": args.lora_rank, "dtype": "float32"})
    configure_process(cfg.model)
    print(json.dumps(measure(cfg, args.repeats, args.seen_groups)))


if __name__ == "__main__":
    main()
