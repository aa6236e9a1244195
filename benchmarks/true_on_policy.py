"""What rollout.true_on_policy costs: CPU engine tokens/s and the trainer's step time, on against off.

The default run's shapes: the default model and dtype (SmolLM2, bf16 where the CPU has it), the
default task's prompts with their chat template, G = 8 samples per prompt, 12 new tokens, an engine
batch of 32, LoRA 16, a step of ``trainer.batch_groups`` groups, one thread per process. Each repeat
generates ``--groups`` groups on an engine with the mode off and on an engine with it on, then runs
one Learner step per mode on the first groups generated with it, alternating, so that both see the
same machine load. The first step of each learner runs at the weights that generated its batch
(staleness 0): its ``logprob_diff`` is the rollout-train mismatch. Prints one JSON line:

  engine_tokens_s / baseline_engine_tokens_s   generated tokens per second of wall time (median)
  trainer_step_s / baseline_trainer_step_s     seconds per Learner.train_step (median)
  ..._cpu_s                                    the same per second of the process's CPU time: on a
                                               shared machine, less of other processes' noise
  engine_tokens_ratio, trainer_step_ratio, ... on / baseline (tokens/s below 1, a step above 1: slower)
  logprob_diff / baseline_logprob_diff         mean |log pi_train - log pi_rollout| of the first step

    .venv/bin/python benchmarks/true_on_policy.py [--model smollm2-135m-instruct] [--dtype auto] [--groups 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time

from milestream.config import Config
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams
from milestream.infra.model import compute_dtype, configure_process, load_tokenizer
from milestream.producers.data import prompt_messages, prompt_stream
from milestream.producers.tasks import chat_input_ids
from milestream.schemas.records import GroupSample
from milestream.train.learner import CollectedGroup, Learner

MODES = {"baseline": False, "on": True}


def prompts(cfg: Config, groups: int) -> list[tuple[int, ...]]:
    tokenizer = load_tokenizer(cfg.model)
    return [tuple(chat_input_ids(tokenizer, prompt_messages(cfg, prompt), cfg.data.assistant_prefill))
            for prompt in itertools.islice(prompt_stream(cfg), groups)]


def generate(engine: CpuEngine, cfg: Config, prompt_ids: list[tuple[int, ...]]) -> tuple[float, float, list]:
    """Every sample of every group submitted at once; (tokens per second, per CPU second, [(prompt,
    results)] per group). No stop token: every sample runs to max_new_tokens, so both modes do the
    same work whatever they sample."""
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    size = cfg.rollout.group_size

    async def run() -> list[GenerateResult]:
        return await asyncio.gather(*(engine.generate(GenerateRequest(f"{g}/{i}", prompt, sampling))
                                      for g, prompt in enumerate(prompt_ids) for i in range(size)))

    started, cpu = time.perf_counter(), time.process_time()
    results = asyncio.run(run())
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(len(r.output_ids) for r in results)
    return tokens / elapsed, tokens / cpu, [(prompt, results[g * size:(g + 1) * size])
                                            for g, prompt in enumerate(prompt_ids)]


def batch(groups: list, count: int) -> list[CollectedGroup]:
    """The first ``count`` groups as the trainer collects them, rewards drawn so advantages are not 0."""
    rng = random.Random(0)
    out = []
    for g, (prompt, results) in enumerate(groups[:count]):
        samples = [GroupSample(f"{g}/{i}", str(g), "p", i, len(results), list(prompt), list(r.output_ids),
                               [1] * len(r.output_ids), list(r.versions), float(rng.random() < 0.5), "completed",
                               "", "e", "w", 0.0, 0.0, logprobs=list(r.logprobs)) for i, r in enumerate(results)]
        out.append(CollectedGroup(str(g), samples, staleness=0))
    return out


def measure(base: Config, groups: int, repeats: int) -> dict:
    cfgs = {mode: base.with_overrides(rollout={"true_on_policy": on}) for mode, on in MODES.items()}
    engines = {mode: CpuEngine(cfg.model, cfg.rollout, seed=1) for mode, cfg in cfgs.items()}
    learners = {mode: Learner(cfg) for mode, cfg in cfgs.items()}
    prompt_ids = prompts(base, groups)
    figures: dict[str, dict[str, list[float]]] = {name: {mode: [] for mode in MODES}
                                                  for name in ("rate", "rate_cpu", "step", "step_cpu")}
    batches, diffs = {}, {}
    for _ in range(repeats):
        for mode in MODES:
            rate, rate_cpu, generated = generate(engines[mode], cfgs[mode], prompt_ids)
            figures["rate"][mode].append(rate)
            figures["rate_cpu"][mode].append(rate_cpu)
            batches.setdefault(mode, batch(generated, base.trainer.batch_groups))
        for mode in MODES:
            started, cpu = time.perf_counter(), time.process_time()
            step = learners[mode].train_step(batches[mode])
            figures["step"][mode].append(time.perf_counter() - started)
            figures["step_cpu"][mode].append(time.process_time() - cpu)
            diffs.setdefault(mode, step["logprob_diff"])
    for engine in engines.values():
        asyncio.run(engine.close())
    out = {"model": base.model.path or base.model.name, "dtype": str(compute_dtype(base.model)).removeprefix("torch."),
           "groups": groups, "samples": groups * base.rollout.group_size, "repeats": repeats}
    for name, key, digits in (("rate", "engine_tokens_s", 1), ("rate_cpu", "engine_tokens_cpu_s", 1),
                              ("step", "trainer_step_s", 3), ("step_cpu", "trainer_step_cpu_s", 3)):
        on, off = (statistics.median(figures[name][mode]) for mode in ("on", "baseline"))
        out.update({key: round(on, digits), f"baseline_{key}": round(off, digits),
                    f"{key.removesuffix('_s')}_ratio": round(on / off, 3)})
    return {**out, "logprob_diff": diffs["on"], "baseline_logprob_diff": diffs["baseline"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = Config().with_overrides(model={"name": args.model, "dtype": args.dtype}, eval={"mode": None})
    configure_process(cfg.model)
    print(json.dumps(measure(cfg, args.groups, args.repeats)))


if __name__ == "__main__":
    main()
