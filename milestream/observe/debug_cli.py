"""``milestream replay`` for offline debugging: select, list, show, export, re-drive (see inspect_log.py).

The run's own configuration (``RUN_DIR/config.yaml``, when ``--config`` is not given) decides the
tokenizer, the processor's drop rules and the trainer's arithmetic, with ``--set`` applied on top.
``--step N`` alone keeps its meaning (recompute step N); with an action it selects step N's groups.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from milestream.config import Config
from milestream.observe.selection import (OffsetRange, Selection, SelectionError, export_parquet, parse_span,
                                          parse_time, sample_table)
from milestream.log.reader import ArchiveSource, BrokerSource, LogSource

ACTIONS = ("list", "show", "export", "redrive")
SELECTORS = ("steps", "group", "since", "until", "topic", "sample")


def add_arguments(command: argparse.ArgumentParser) -> None:
    pick = command.add_argument_group("offline debugging: select (all given must hold), then act")
    pick.add_argument("--from-broker", action="store_true", help="read the run's topics on the broker "
                      "(--bootstrap-servers, or the one RUN_DIR/config.yaml names) instead of RUN_DIR/archive")
    pick.add_argument("--steps", help="A:B or N: the groups these trainer steps trained (with --step N: N)")
    pick.add_argument("--group", action="append", default=[], help="a group id (repeatable)")
    pick.add_argument("--since", help="rollout records stamped at or after (unix seconds or ISO 8601)")
    pick.add_argument("--until", help="rollout records stamped before (unix seconds or ISO 8601)")
    pick.add_argument("--topic", help="with --partition and --offsets: the samples or groups those records name")
    pick.add_argument("--partition", type=int, default=0)
    pick.add_argument("--offsets", default="0:9223372036854775807", help="A:B or N, inclusive")
    pick.add_argument("--sample", type=int, help="only this sample index of each group")
    pick.add_argument("--list", action="store_true", help="one line per selected group (the default action)")
    pick.add_argument("--show", action="store_true", help="print the selected trajectories: decoded text, "
                      "per-token log-prob, version and loss mask, reward, status, drop reason")
    pick.add_argument("--limit", type=int, default=4, help="--show prints at most this many trajectories")
    pick.add_argument("--export", metavar="PATH", help="write the selection to Parquet, one row per sample")
    pick.add_argument("--redrive", choices=["processor", "trainer"], help="processor: the group rules on the "
                      "logged rollout records, compared with the logged groups and drops; trainer: recompute "
                      "--steps A:B bit for bit")


def wants(args: argparse.Namespace) -> bool:
    """Whether the command line asks for offline debugging (``--step N`` alone recomputes step N)."""
    return any(getattr(args, name) for name in ACTIONS) or any(
        getattr(args, name) not in (None, []) for name in SELECTORS)


def selection(args: argparse.Namespace) -> Selection:
    steps = parse_span(args.steps, "--steps") if args.steps else None if args.step is None else (args.step, args.step)
    offsets = None
    if args.topic:
        first, last = parse_span(args.offsets, "--offsets")
        offsets = OffsetRange(args.topic, args.partition, first, last)
    return Selection(steps=steps, group_ids=frozenset(args.group), offsets=offsets, sample_index=args.sample,
                     since_ms=parse_time(args.since) if args.since else None,
                     until_ms=parse_time(args.until) if args.until else None)


def text_decoder(cfg: Config):
    from milestream.infra.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def run(cfg: Config, args: argparse.Namespace) -> int:
    """``cfg``: the run's configuration (cli.finished_run). A bad selection, or one nothing on the log meets,
    raises SelectionError (a UserError: cli.main says it, exit status 2)."""
    source: LogSource = BrokerSource(cfg) if args.from_broker else ArchiveSource(cfg.run_path)
    if args.redrive == "processor":
        from milestream.observe.redrive import redrive_processor

        report = redrive_processor(cfg, source)
        print(json.dumps(report.summary()))
        return 0 if report.agrees else 1
    if args.redrive == "trainer":
        return _redrive_trainer(cfg, args, source)
    table = selection(args).pick(sample_table(source, text_decoder(cfg)), source)
    if args.export:
        path = export_parquet(table, args.export)
        print(f"wrote {table.num_rows} samples of {len(pc.unique(table['group_id']))} groups to {path}")
    if args.show:
        from milestream.observe.show import print_trajectories

        print_trajectories(table.slice(0, args.limit).to_pylist())
        if table.num_rows > args.limit:
            print(f"({table.num_rows - args.limit} more selected samples not shown: narrow the selection or raise --limit)")
    if args.list or not (args.export or args.show):
        from milestream.observe.show import print_groups

        print_groups(group_summary(table))
    return 0


def _redrive_trainer(cfg: Config, args: argparse.Namespace, source: LogSource) -> int:
    from milestream.observe.redrive import redrive_trainer

    steps = selection(args).steps
    if steps is None:
        raise SelectionError("--redrive trainer needs --steps A:B (or --step N)")
    first, last = steps
    results = redrive_trainer(cfg, Path(cfg.run_path), source, first, last)
    for result in results:
        print(json.dumps({"step": result.step, "from_checkpoint": result.from_checkpoint, "logged": result.logged,
                          "replayed": result.replayed, "bitwise_equal": result.bitwise_equal}))
    return 0 if all(r.bitwise_equal for r in results) else 1


def group_summary(table: pa.Table) -> pa.Table:
    """One row per selected group: its fate, sample count, mean reward and first record's time."""
    return table.group_by(["group_id", "outcome", "step", "staleness", "drop_reason"], use_threads=False).aggregate([
        ("sample_index", "count"), ("reward", "mean"), ("timestamp_ms", "min")]).sort_by([("timestamp_ms_min", "ascending")])
