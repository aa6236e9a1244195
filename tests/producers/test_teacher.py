"""The teacher stage of on-policy distillation (producers/teacher.py) on a real broker and Redis: it scores
each trajectory on the teacher folder, dead-letters what no rollout worker of the run wrote, and a restarted
teacher goes on from its committed offsets."""
from __future__ import annotations

import asyncio
import time

import pytest
from model_folders import tiny_random_folder

from milestream.engines.engine import CpuEngine
from milestream.engines.scoring import ScoreRequest
from milestream.infra.kafka import RecordProducer
from milestream.infra.model import ModelFolderError
from milestream.log.reader import BrokerSource
from milestream.producers.teacher import TeacherStage, check_teacher, teacher_model
from milestream.schemas import topics
from milestream.schemas.records import Trajectory
from milestream.streams.ledger import BufferLedger


def trajectory(group: str, index: int, response: list[int], size: int = 4) -> Trajectory:
    return Trajectory(f"{group}/{index}", group, group.split("#")[0], index, size, [1, 2, 3 + index], response,
                      [1] * len(response), [0] * len(response), 0.0, "truncated", "", "e", "w", 0.0, 0.0)


def publish(cfg, group: str, hostile: list[Trajectory] = ()) -> list[Trajectory]:
    """A group a rollout worker admitted, after ``hostile`` records in its partition (read first)."""
    BufferLedger(cfg).admit(group, "test", 0)
    samples = [trajectory(group, i, [10 + i, 20, 30 + i][:i + 1]) for i in range(4)]
    producer = RecordProducer(cfg.broker)
    for record in [*hostile, *samples]:
        producer.send(topics.TRAJECTORIES, [record], key=group)
    producer.flush()
    return samples


def score_all(stage: TeacherStage, count: int) -> None:
    async def run() -> None:
        published, deadline = 0, time.monotonic() + 120  # a hang guard
        while published < count:
            assert time.monotonic() < deadline, f"{published} of {count} trajectories scored"
            published += await stage.step(timeout=1.0)
        await stage.close()
    asyncio.run(run())


def test_the_teacher_scores_each_trajectory_dead_letters_the_rest_and_resumes(cfg, tmp_path) -> None:
    cfg = cfg.with_overrides(distill={"teacher_path": str(tiny_random_folder(tmp_path / "teacher", 3.0))},
                             rollout={"true_on_policy": True})
    check_teacher(cfg)
    hostile = [trajectory("stranger#0", 0, [5]), trajectory("g#0", 1, [5, 60_000])]
    first = publish(cfg, "g#0", hostile)
    score_all(TeacherStage(cfg), 4)
    second = publish(cfg, "h#0")
    score_all(TeacherStage(cfg), 4)  # restarted: from where the first one committed

    source = BrokerSource(cfg)
    source.prefetch((topics.TEACHER_LOGPROBS, topics.DEADLETTER))
    records = {r.trajectory_id: r for m in source.messages(topics.TEACHER_LOGPROBS) for r in m.records}
    assert sum(len(m.records) for m in source.messages(topics.TEACHER_LOGPROBS)) == len(records) == 8
    engine = CpuEngine(teacher_model(cfg), cfg.rollout)
    expected = asyncio.run(engine.score([ScoreRequest(tuple(t.prompt_ids), tuple(t.response_ids), 1.0)
                                         for t in first + second]))
    asyncio.run(engine.close())
    for t, logprobs in zip(first + second, expected):
        record = records[t.trajectory_id]
        assert (record.group_id, record.sample_index, record.logprobs) == (t.group_id, t.sample_index, logprobs)
        assert record.teacher == cfg.distill.teacher_path
    letters = [r for m in source.messages(topics.DEADLETTER) for r in m.records]
    assert sorted(r.field for r in letters) == ["group_id", "response_ids"]
    assert {r.source_topic for r in letters} == {cfg.broker.topic_prefix + topics.TRAJECTORIES.name}


def test_a_teacher_of_another_vocabulary_is_refused_before_the_run_starts(cfg, tmp_path) -> None:
    folder = tiny_random_folder(tmp_path / "teacher")
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|end|>"'))
    with pytest.raises(ModelFolderError, match="vocabulary is not the student's"):
        check_teacher(cfg.with_overrides(distill={"teacher_path": str(folder)}))
