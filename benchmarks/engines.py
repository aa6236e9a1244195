"""The built-in CPU engine and vLLM's CPU build (rollout.engine vllm) side by side, in one process's run.

The default run's shapes: the default model and dtype (SmolLM2, bf16 where the CPU has it, LoRA 16: vLLM serves
the adapters merged), the default task's prompts with their chat template, ``--groups`` prompts x G = 8 samples
all submitted at once, no stop token (every sample runs to its length, so both engines do the same work), at each
of ``--tokens`` new tokens. vLLM runs as ``milestream run`` starts it (engines/vllm.py ``server_argv``). Per engine:

  tokens_s_N      generated tokens per second of wall time at N new tokens
  update_s        a new version handed to the engine until it serves it (median of ``--updates``): the CPU
                  engine copies the adapters in; vLLM merges them, writes the folder, pauses, reloads, labels
                  the version, resumes and checks /weight_checker
  update_pause_s  of that, how long generation was held still
  logprob_diff    mean |log pi_train - log pi_rollout| of a trainer step on the engine's first groups at
                  staleness 0 (the first N of --tokens)
and vllm / cpu ratios of each. ``--repeats`` rounds, each measuring the CPU engine then vLLM (interleaved, one vLLM
server for all): each figure is the median over the rounds, with its spread (min, max) under ``spread``; the ratios
are of the medians. Prints one JSON line.

    .venv/bin/python benchmarks/engines.py [--groups 8] [--tokens 12 256] [--updates 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from true_on_policy import batch, prompts  # benchmarks/ is a folder of scripts: this one's own folder is on the path
from milestream.config import Config
from milestream.engines.engine import CpuEngine, Engine, GenerateRequest, SamplingParams
from milestream.engines.vllm import VLLM_VERSION, VllmEngine
from milestream.infra.model import compute_dtype, configure_process, load_model, trainable_state_dict
from milestream.infra.secret_env import control_token
from milestream.train.learner import Learner
from milestream_testkit.vllm_server import VllmServer


async def generate(engine: Engine, cfg: Config, prompt_ids: list[tuple[int, ...]], new_tokens: int) -> tuple[float, list]:
    """(tokens per second, [(prompt, results)] per group)."""
    sampling, size = SamplingParams(new_tokens, cfg.rollout.temperature), cfg.rollout.group_size
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(GenerateRequest(f"{g}/{i}", prompt, sampling))
                                     for g, prompt in enumerate(prompt_ids) for i in range(size)))
    rate = sum(len(r.output_ids) for r in results) / (time.perf_counter() - started)
    return rate, [(prompt, results[g * size:(g + 1) * size]) for g, prompt in enumerate(prompt_ids)]


async def updates(engine: Engine, tensors: dict[str, torch.Tensor], versions: range) -> tuple[float, float]:
    """Median seconds of an update, and of its pause."""
    took, paused = [], []
    for version in versions:
        started = time.perf_counter()
        await engine.update_weights(version, tensors)
        took.append(time.perf_counter() - started)
        paused.append(engine.update_pause_s)
    return statistics.median(took), statistics.median(paused)


async def measure_engine(engine: Engine, cfg: Config, prompt_ids: list, tokens: list[int], versions: range) -> dict:
    figures, first = {}, None
    for new_tokens in tokens:
        rate, groups = await generate(engine, cfg, prompt_ids, new_tokens)
        figures[f"tokens_s_{new_tokens}"] = round(rate, 1)
        first = first or groups
    # staleness 0: a learner at the weights that generated the groups, before any update
    step = await asyncio.to_thread(Learner(cfg).train_step, batch(first, cfg.trainer.batch_groups))
    tensors = trainable_state_dict(load_model(cfg.model, dtype=torch.float32))
    update_s, pause_s = await updates(engine, tensors, versions)
    return {**figures, "update_s": round(update_s, 3), "update_pause_s": round(pause_s, 3),
            "logprob_diff": step["logprob_diff"]}


async def measure(cfg: Config, groups: int, tokens: list[int], count: int, repeats: int, folder: Path) -> dict:
    prompt_ids = prompts(cfg, groups)
    server = VllmServer(cfg, folder / "vllm.log")
    cpu = CpuEngine(cfg.model, cfg.rollout, seed=1)
    vllm = VllmEngine(server.url, weights_dir=folder / "weights", model=cfg.model, dtype=compute_dtype(cfg.model),
                      token=control_token(cfg).value)
    rounds: dict[str, list[dict]] = {"cpu": [], "vllm": []}
    try:
        for r in range(repeats):
            versions = range(r * count + 1, (r + 1) * count + 1)  # each round's versions newer than the last's
            for name, engine in (("cpu", cpu), ("vllm", vllm)):
                rounds[name].append(await measure_engine(engine, cfg, prompt_ids, tokens, versions))
    finally:
        await cpu.close()
        await vllm.close()
        server.stop()
    figures = {name: {key: statistics.median(f[key] for f in found) for key in found[0]} for name, found in rounds.items()}
    spread = {name: {key: [min(f[key] for f in found), max(f[key] for f in found)] for key in found[0]}
              for name, found in rounds.items()}
    ratios = {f"{key}_ratio": round(figures["vllm"][key] / figures["cpu"][key], 3)
              for key in figures["cpu"] if figures["cpu"][key]}
    return {"model": cfg.model.path or cfg.model.name, "dtype": str(compute_dtype(cfg.model)).removeprefix("torch."),
            "vllm_version": VLLM_VERSION, "samples": groups * cfg.rollout.group_size, "updates": count,
            "repeats": repeats, **figures, **ratios, "spread": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[12, 256])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="milestream-engines-") as folder:
        cfg = Config().with_overrides(eval={"mode": None}, run={"run_dir": folder})
        configure_process(cfg.model)
        print(json.dumps(asyncio.run(measure(cfg, args.groups, args.tokens, args.updates, args.repeats, Path(folder)))))


if __name__ == "__main__":
    main()
