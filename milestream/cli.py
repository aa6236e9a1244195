"""``milestream run | rollout | process | train | load-prompts | topics`` over the one typed Config."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from milestream.config import Config, load_config


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one knob, e.g. --set trainer.lr=5e-5 (repeatable)")
    parser.add_argument("--bootstrap-servers", help="an existing Kafka cluster (default: start the embedded broker)")
    parser.add_argument("--redis-url", help="an existing Redis (default: start an embedded redis-server)")
    parser.add_argument("--run-dir", help="the run folder (checkpoints, weights, summary)")
    parser.add_argument("--log-level", default="INFO")


def build_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.bootstrap_servers:
        overrides.append(f"broker.bootstrap_servers={args.bootstrap_servers}")
    if args.redis_url:
        overrides.append(f"redis.url={args.redis_url}")
    if args.run_dir:
        overrides.append(f"run.run_dir={args.run_dir}")
    return load_config(args.config, overrides)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.orchestrator import run_loop

    summary = run_loop(cfg)
    return 0 if summary.get("steps", 0) > 0 else 1


def _rollout(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.producers.worker import run_worker

    run_worker(cfg, worker_id=args.worker_id)
    return 0


def _process(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.streams.processor import run_processor

    run_processor(cfg)
    return 0


def _train(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.consumers.trainer import run_trainer

    run_trainer(cfg)
    return 0


def _load_prompts(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.producers.loader import feed_prompts, load_prompts

    if args.follow:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        count = feed_prompts(cfg, lookahead=args.lookahead or 2 * cfg.buffer_capacity, stop=stop)
    else:
        count = load_prompts(cfg, start=args.start, count=args.count)
    print(f"published {count} prompts")
    return 0


def _topics(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.infra.kafka import Admin
    from milestream.infra.services import services

    with services(cfg) as live:
        admin = Admin(live.broker)
        if args.action == "create":
            created = admin.create_topics()
            print(f"created {len(created)} topics: {', '.join(created) or '-'}")
        for name, partitions in sorted(admin.list_topics().items()):
            print(f"{name:32s} {partitions:3d} partitions")
    return 0


COMMANDS = {
    "run": (_run, "start broker, Redis, processor, rollout and trainer; train; write summary.json"),
    "rollout": (_rollout, "run a rollout worker (engine + async sampling)"),
    "process": (_process, "run the stream processor (faust worker)"),
    "train": (_train, "run the trainer"),
    "load-prompts": (_load_prompts, "publish task prompts on the prompts topic (--follow: keep feeding)"),
    "topics": (_topics, "create or list the topics"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="milestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        _common(command)
        if name == "rollout":
            command.add_argument("--worker-id", default="worker-0")
        if name == "load-prompts":
            command.add_argument("--start", type=int, default=0)
            command.add_argument("--count", type=int, default=1000)
            command.add_argument("--follow", action="store_true",
                                 help="keep --lookahead prompts ahead of rollout admissions until stopped")
            command.add_argument("--lookahead", type=int, help="default: twice the buffer capacity")
        if name == "topics":
            command.add_argument("action", choices=["create", "list"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    for noisy in ("aiokafka", "faust", "mode", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cfg = build_config(args)
    return COMMANDS[args.command][0](cfg, args)


if __name__ == "__main__":
    sys.exit(main())
