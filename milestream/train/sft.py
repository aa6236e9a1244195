"""SFT: the trainer's learner with the supervised loss, on a data set; no rollout engine, no broker.

An example is a prompt exactly as rollout builds it (system prompt, question, the assistant turn
pre-filled) and its reference answer closed by ``</answer>`` and the end of turn; the loss is the
negative log-likelihood of the answer tokens. The data set is the configured reasoning-gym task, or
a JSONL file of ``{"question": ..., "answer": ...}`` lines (``data.sft_path``). A step
takes ``trainer.batch_groups`` × ``rollout.group_size`` examples (as many samples as an RL step), in
order, wrapping around. Checkpoints are the trainer's, so ``trainer.backend`` and resume work alike.

    milestream sft --run-dir runs/sft --set trainer.steps=20 [--set data.sft_path=examples.jsonl]
"""
from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Iterator

from milestream.config import Config
from milestream.train import checkpoint
from milestream.train.learner import CollectedGroup, Learner
from milestream.infra.model import configure_process, end_of_turn_id, load_tokenizer
from milestream.producers.tasks import build_input_ids, iter_prompts
from milestream.schemas.records import GroupSample

log = logging.getLogger(__name__)


def examples(cfg: Config) -> list[tuple[str, str]]:
    """(question, answer) pairs from the JSONL file, or the first ``data.size`` of the task."""
    data_path = cfg.data.sft_path
    if data_path:
        rows = [json.loads(line) for line in Path(data_path).read_text().splitlines() if line.strip()]
        for number, row in enumerate(rows, 1):
            if not isinstance(row.get("question"), str) or "answer" not in row:
                raise ValueError(f"{data_path}:{number}: a line needs a string 'question' and an 'answer'")
        return [(row["question"], str(row["answer"])) for row in rows]
    return [(p.question, p.answer) for p in iter_prompts(cfg.data, stop=cfg.data.size)]


def sample(cfg: Config, tokenizer, index: int, question: str, answer: str) -> GroupSample:
    """One example as a one-sample group: every response token is trained."""
    prompt_ids = build_input_ids(tokenizer, question, cfg.data)
    response_ids = list(tokenizer(f"{answer}</answer>", add_special_tokens=False)["input_ids"])
    response_ids.append(end_of_turn_id(tokenizer))  # what the chat template closes an assistant turn with
    n = len(response_ids)
    return GroupSample(f"sft-{index}/0", f"sft-{index}", f"sft-{index}", 0, 1, prompt_ids, response_ids, [1] * n,
                       [0] * n, 0.0, "completed", answer, "dataset", "sft", 0.0, 0.0, logprobs=[0.0] * n)


def batches(cfg: Config, data: list[tuple[str, str]], first_step: int) -> Iterator[list[CollectedGroup]]:
    tokenizer = load_tokenizer(cfg.model)
    size = cfg.trainer.batch_groups * cfg.rollout.group_size
    order = itertools.islice(itertools.cycle(range(len(data))), first_step * size, None)
    while True:
        chosen = list(itertools.islice(order, size))
        yield [CollectedGroup(f"sft-{i}", [sample(cfg, tokenizer, i, *data[i])], 0) for i in chosen]


def run_sft(cfg: Config) -> list[dict[str, float]]:
    """Train ``trainer.steps`` steps (resuming from the run's checkpoint); the figures of each step."""
    configure_process(cfg.model)
    cfg = cfg.with_overrides(trainer={"objective": "supervised"})
    learner = Learner(cfg)
    payload = checkpoint.load_latest(cfg.run.run_dir)
    state = checkpoint.TrainerState()
    if payload is not None:
        learner.load_state_dict(payload["backend"])
        state = checkpoint.restore(payload)
    data = examples(cfg)
    history = []
    out = Path(cfg.run.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for batch in batches(cfg, data, state.step):
        if state.step >= cfg.trainer.steps:
            break
        figures = learner.train_step(batch)
        state.step += 1
        state.version += 1
        history.append({"step": state.step, **figures})
        if learner.backend.rank == 0:
            with open(out / "sft_steps.jsonl", "a") as steps_file:
                steps_file.write(json.dumps(history[-1]) + "\n")
            log.info("sft step %d nll/token %.4f grad norm %.3f", state.step, figures["nll_mean"], figures["grad_norm"])
        if state.step % cfg.trainer.checkpoint_every == 0 or state.step == cfg.trainer.steps:
            learner_state = learner.state_dict()  # collective: every rank
            if learner.backend.rank == 0:
                checkpoint.save(out, state, learner_state, keep=cfg.trainer.keep_checkpoints)
    return history
