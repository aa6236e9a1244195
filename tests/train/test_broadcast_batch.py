"""The trainer's batch reaches every rank as Arrow bytes (train/trainer.py ``broadcast_batch``): two gloo
ranks in two processes, the second gets the leader's groups field for field, and None (stop) as None."""
from __future__ import annotations

import torch.distributed as dist
import torch.multiprocessing as mp

from milestream.train.learner import CollectedGroup
from milestream.train.trainer import broadcast_batch
from milestream.schemas.records import GroupSample


def sample(group_id: str, index: int) -> GroupSample:
    return GroupSample(f"{group_id}/{index}", group_id, "p", index, 2, [1, 2, 3], [4, 5 + index], [1, 1], [0, 1],
                       0.5 * index, "completed", "ab", "e", "w", 1.0, 2.0, 0, "", "", logprobs=[-0.5, -1.25])


BATCH = [CollectedGroup("g#0", [sample("g#0", 0), sample("g#0", 1)], 1),
         CollectedGroup("h#1", [sample("h#1", 0), sample("h#1", 1)], 0)]


def rank_main(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        got = broadcast_batch(BATCH if rank == 0 else None, rank == 0)
        stop = broadcast_batch(None, rank == 0)
        results[rank] = (got, stop)
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_leaders_batch_and_the_stop(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(str(tmp_path / "init"), results), nprocs=2, join=True)
        assert results[1] == (BATCH, None) and results[0] == (BATCH, None)
