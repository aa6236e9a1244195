"""``milestream export-rollouts --run-dir RUN --out DIR [--steps A:B] [--min-reward X]``: a run's logged rollouts as a
data set, for SFT on the best samples (rejection sampling) or offline RL elsewhere.

``DIR/rollouts.parquet`` holds one row per logged trajectory sample, the columns of ``replay --export``
(observe/selection.py): prompt and response as text and token ids, reward and status, the behaviour log-probs,
the weight version of every token, the group and its fate (the step that trained it and its staleness then,
or why it was dropped). ``datasets.load_dataset("parquet", data_files="DIR/rollouts.parquet")``, DuckDB, pandas
and Spark read it as it is. A dict reward's components are not on the log per sample (the workers' metrics
carry their means): ``reward`` is the one that trained. ``--steps A:B`` keeps the groups those trainer steps
trained; ``--min-reward X`` the samples whose reward is at least X.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc

from milestream.config import Config, UserError
from milestream.log.reader import ArchiveSource
from milestream.observe.debug_cli import text_decoder
from milestream.observe.selection import Selection, export_parquet, sample_table

FILE = "rollouts.parquet"


@dataclass(frozen=True)
class ExportedRollouts:
    path: Path
    samples: int
    groups: int


def export_rollouts(cfg: Config, out: str | Path, steps: tuple[int, int] | None = None,
                    min_reward: float | None = None) -> ExportedRollouts:
    """The samples of the run ``cfg`` names (its archive, decoded with its tokenizer) into ``out``, a new folder."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty: the rollouts are written into a new folder")
    source = ArchiveSource(cfg.run_path)
    table = Selection(steps=steps).pick(sample_table(source, text_decoder(cfg)), source)
    if min_reward is not None:
        table = table.filter(pc.fill_null(pc.greater_equal(table["reward"], min_reward), False))
    path = export_parquet(table, out / FILE)
    return ExportedRollouts(path, table.num_rows, len(pc.unique(table["group_id"])))
