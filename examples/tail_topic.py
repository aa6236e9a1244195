"""Tail any milestream topic: each record decoded and handed to ``handle``, which prints it as JSON.

A complete consumer on the thin Kafka layer (``milestream.infra.kafka``) and the codec
(``milestream.schemas.codec``): copy it and put your own logic into ``handle``. Against a running
``milestream run --run-dir runs/demo`` (its config.yaml names the broker and the topic prefix):

    .venv/bin/python examples/tail_topic.py --config runs/demo/config.yaml --topic buffer.dropped

Bad input is reported with the topic, partition, offset and field the codec names, and skipped. Once the
run is over (no broker answers), the same records come from its archive (RUN_DIR/archive, the run's
``run.run_dir``), read by the one log reader (``milestream.log.reader``), and the script stops at its end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from milestream.config import Config, UserError, load_config
from milestream.infra.kafka import RecordConsumer
from milestream.log.reader import SkipBadRecords, read_archive
from milestream.observe.feed import archive_instead, live_topics
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Record


def handle(record: Record, position: Position) -> None:
    """Your logic goes here. This one prints the record's fields as one JSON line (bytes as their length)."""
    fields = {name: f"<{len(value)} bytes>" if isinstance(value, bytes) else value
              for name, value in record.to_row().items()}
    print(json.dumps({"at": str(position), "type": type(record).__name__, **fields}), flush=True)


def tail_live(cfg: Config, spec: topics.TopicSpec, args: argparse.Namespace) -> None:
    # A consumer group: instances of this script share the topic's partitions, and a restarted one
    # carries on after the last offset it committed.
    consumer = RecordConsumer(cfg.broker, spec, group_id=cfg.broker.topic_prefix + args.group).subscribe()
    handled, last_seen = 0, None
    try:
        while args.max_records is None or handled < args.max_records:
            try:
                delivery = consumer.poll(1.0)  # decodes the Arrow IPC value into records (the codec)
            except RecordError as exc:  # names topic, partition, offset and field; the consumer moved past it
                print(f"skipped: {exc}", file=sys.stderr, flush=True)
                continue
            if delivery is None:
                if args.idle_s is not None and last_seen is not None and time.monotonic() - last_seen > args.idle_s:
                    break
                continue
            last_seen = time.monotonic()
            for record in delivery.records:  # one value may carry several records (a group: G samples)
                handle(record, delivery.position)
                handled += 1
            # commit after handling: a crash in between hands the value over again, never loses it
            consumer.commit({delivery.position.partition: delivery.position.offset + 1})
    finally:
        consumer.close()


def tail_archive(cfg: Config, spec: topics.TopicSpec, args: argparse.Namespace) -> None:
    """The finished run's records of ``spec``, partition by partition in offset order (no group, nothing committed)."""
    handled = 0
    for message in read_archive(cfg.run_path, spec, SkipBadRecords()):  # a bad value: logged and skipped
        for record in message.records:
            if args.max_records is not None and handled >= args.max_records:
                return
            handle(record, message.position)
            handled += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", required=True, choices=[spec.name for spec in topics.CATALOGUE])
    parser.add_argument("--config", help="a run's config.yaml (broker address, topic prefix, run folder)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--group", default="tail-topic", help="consumer group (prefixed with the run's topic prefix)")
    parser.add_argument("--max-records", type=int, help="stop after this many records")
    parser.add_argument("--idle-s", type=float, help="stop once no record came for this long (after the first)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    spec = topics.by_name(args.topic)  # the record type every value of the topic decodes to
    if live_topics(cfg):  # a quick, quiet probe of the broker the configuration names
        tail_live(cfg, spec, args)
        return 0
    try:
        print(archive_instead(cfg), file=sys.stderr, flush=True)
    except UserError as exc:  # no broker, and no archive either
        print(exc, file=sys.stderr)
        return 2
    tail_archive(cfg, spec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
