"""``milestream run | rollout | process | train | teacher | load-prompts | topics | archive | replay | export
| mismatch | track | ...`` over the one typed Config."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from milestream.cli_offline import (audit, build_config, compare, export, export_rollouts, finished_run, fork, mismatch,
                                    mismatch_arguments, plot, replay, replay_arguments, run_configuration)
from milestream.config import Config, ConfigError, UserError
from milestream.infra.lifecycle import stop_on_signals

USER_ERROR = 2  # the exit status of a UserError (config.py): what was given or asked for is wrong
DEBUG_HELP = "on an error in what was given (exit status 2), print its traceback too"
EXIT_STATUSES = """exit status:
  0  done (a check passed)
  1  a check found a difference (audit, replay --step / --redrive, mismatch: see each), or a run trained nothing
  2  what was given or asked for is wrong (a knob, a file, a run folder, a selection): the message says
     what; --debug adds the traceback
  a traceback without --debug: a bug"""


STAGE_BROKER = "the run's Kafka cluster (default: broker.bootstrap_servers of --config)"
STAGE_REDIS = "the run's Redis (default: redis.url of --config)"
RUN_BROKER = "the run's Kafka cluster (default: the one --config, else RUN_DIR/config.yaml, names)"
RUN_REDIS = "the run's Redis (default: the one --config, else RUN_DIR/config.yaml, names)"
# what --bootstrap-servers and --redis-url mean to each command (None: it uses neither; the flag is accepted,
# not shown): only `run` and `topics` start embedded services
SERVICES: dict[str, tuple[str | None, str | None]] = {
    "run": ("an existing Kafka cluster (default: start the embedded broker)",
            "an existing Redis (default: start an embedded redis-server)"),
    "topics": ("create: an existing Kafka cluster (default: start the embedded broker, for as long as the command "
               f"runs); list: {RUN_BROKER}, else the run's archive", None),
    **dict.fromkeys(("process", "train", "teacher", "eval", "load-prompts", "verify-weights"),
                    (STAGE_BROKER, STAGE_REDIS)),
    "rollout": (RUN_BROKER, RUN_REDIS),  # a worker may join a run by its --run-dir alone
    "archive": (STAGE_BROKER, None),
    **dict.fromkeys(("metrics", "track", "plot", "mismatch"), (RUN_BROKER, None)),
    "replay": (f"--from-broker: {RUN_BROKER}; --republish, --resume: the one to put the run back into",
               "--resume: the Redis whose buffer ledger is reconciled (default: redis.url of --config)"),
}


def _common(parser: argparse.ArgumentParser, command: str) -> None:
    broker, redis = SERVICES.get(command, (None, None))
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one knob, e.g. --set trainer.lr=5e-5 (repeatable)")
    parser.add_argument("--bootstrap-servers", help=broker or argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=redis or argparse.SUPPRESS)
    parser.add_argument("--run-dir", help="the run folder (checkpoints, weights, summary)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def _run(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.orchestrator import run_loop

    summary = run_loop(cfg)
    return 0 if summary.get("steps", 0) > 0 else 1


def _rollout(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.evaluate.evaluation import shared_evaluation
    from milestream.producers.worker import run_worker

    cfg = run_configuration(cfg, args)  # --run-dir alone: a worker joining that run, on its config.yaml
    run_worker(cfg, worker_id=args.worker_id, hook=shared_evaluation(cfg, args.worker_id))
    return 0


def _process(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.streams.processor import run_processor

    run_processor(cfg)
    return 0


def _train(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.train.backends import launch

    if args.shadow:
        if (cfg.run_path / "archive").exists():
            raise ConfigError(f"train --shadow: {cfg.run_path} holds a run's log; give the shadow a --run-dir of "
                              "its own")
        cfg = cfg.with_overrides(trainer={"shadow": True})
    # local: in this process; fsdp2 / megatron: trainer.ranks processes under torchrun, which passes
    # a SIGTERM on to them (raised here as SystemExit, so launch stops torchrun instead of orphaning it)
    if cfg.trainer.backend != "local":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    launch(cfg, "milestream.train.trainer:run_trainer", nproc=cfg.trainer.ranks)
    return 0


def _sft(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.train.backends import launch

    launch(cfg, "milestream.train.sft:run_sft", nproc=cfg.trainer.ranks)
    return 0


def _load_prompts(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.producers.inputs import check_inputs
    from milestream.producers.loader import feed_prompts, load_prompts

    check_inputs(cfg)
    if args.follow:
        count = feed_prompts(cfg, lookahead=args.lookahead or 2 * cfg.buffer_capacity, stop=stop_on_signals())
    else:
        count = load_prompts(cfg, start=args.start, count=args.count)
    print(f"published {count} prompts")
    return 0


def _metrics(cfg: Config, args: argparse.Namespace) -> int:
    cfg = run_configuration(cfg, args)
    port = args.prometheus_port if args.prometheus_port is not None else (9464 if args.serve else None)
    if port is None and not args.jsonl:
        from milestream.observe.live import watch

        watch(cfg, threading.Event() if args.once else stop_on_signals(), once=args.once)
        return 0
    from milestream.observe.prometheus import serve

    serve(cfg, stop_on_signals(), port, args.prometheus_addr, args.jsonl)
    return 0


def _track(cfg: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from milestream.observe.track import open_trackers, track

    if args.from_archive:  # the archived run's own configuration, and its folder as the run's
        args = argparse.Namespace(**{**vars(args), "run_dir": args.from_archive})
        cfg = finished_run(build_config(args), args)
    else:
        cfg = run_configuration(cfg, args)
    chosen = {"tensorboard": args.tensorboard is not None, "tensorboard_dir": args.tensorboard or None,
              "wandb": args.wandb or "off", "mlflow_uri": args.mlflow_uri}
    if args.tensorboard is not None or args.wandb or args.mlflow_uri:  # these writers alone, not the configured
        cfg = cfg.with_overrides(observe=chosen)
    if not cfg.observe.writers:
        raise ConfigError("no tracker to write: give --tensorboard, --wandb or --mlflow-uri, or set "
                          "observe.tensorboard, observe.wandb or observe.mlflow_uri")
    archive = Path(args.from_archive) if args.from_archive else None
    # before the stores are opened (seconds): a tracker told to stop while it starts still writes what the
    # run published, reading to the log's end
    stop = stop_on_signals()
    trackers = open_trackers(cfg, cfg.observe.writers)
    if archive is not None:  # an old run's folder gets new files: say which
        print(f"writing the archived run {archive} into its folder: each writer's position under "
              f"{trackers[0].position.parent}", flush=True)
    for tracker in trackers:
        print(f"{tracker.sink.name}: writing to {tracker.target}", flush=True)
    for tracker in track(cfg, trackers, stop, archive):
        print(f"{tracker.sink.name}: {tracker.target}, up to step {tracker.written.step}", flush=True)
    return 0


def _verify_weights(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.streams.weights.verify import WeightVerifier

    stop = stop_on_signals()  # before the set-up: a stage told to stop while it starts stops in order
    WeightVerifier(cfg).run(stop)
    return 0


def _teacher(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.producers.teacher import run_teacher

    run_teacher(cfg, stop_on_signals())
    return 0


def _eval(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.evaluate.evaluation import run_evaluator

    run_evaluator(cfg, stop_on_signals())
    return 0


def _engine(cfg: Config, args: argparse.Namespace) -> int:
    if args.engines > 1:
        from milestream.engines.fleet import serve_engines

        return serve_engines(cfg, host=args.host, port=args.port, engine_id=args.engine_id, count=args.engines)
    from milestream.engines.engine_server import serve_engine

    serve_engine(cfg, host=args.host, port=args.port, engine_id=args.engine_id)
    return 0


def _serve_vllm(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.engines.vllm import serve_vllm

    serve_vllm(cfg, host=args.host, port=args.port)


def _router(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.engines.router import serve_router, sglang_router_args

    if args.sglang:  # the same routing on sglang-router (gpu extra); see sglang_router_args for what differs
        command = sglang_router_args(cfg.router)
        os.execv(command[0], command)
    serve_router(cfg)
    return 0


def _topics(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.infra.kafka import Admin
    from milestream.infra.services import services

    if args.action == "list":
        return _list_topics(run_configuration(cfg, args))
    with services(cfg) as live:
        admin = Admin(live.broker)
        created = admin.create_topics()
        print(f"created {len(created)} topics: {', '.join(created) or '-'}")
        for name, partitions in sorted(admin.list_topics().items()):
            print(f"{name:32s} {partitions:3d} partitions")
    return 0


def _list_topics(cfg: Config) -> int:
    """The topics of the broker the run names; of a run that is over, those its archive holds, with their messages
    (no broker is started to list nothing)."""
    from milestream.infra.kafka import Admin
    from milestream.log.archive import load_manifest, read_topic
    from milestream.observe.feed import archive_instead, live_topics

    if live_topics(cfg):
        for name, partitions in sorted(Admin(cfg.broker).list_topics().items()):
            print(f"{name:32s} {partitions:3d} partitions")
        return 0
    print(archive_instead(cfg))
    manifest = load_manifest(cfg.run_path)
    for name, shape in sorted(manifest["topics"].items()):
        messages = read_topic(cfg.run_path, name, ("partition", "offset")).num_rows
        print(f"{manifest['topic_prefix'] + name:32s} {shape['partitions']:3d} partitions {messages:8d} messages")
    return 0


def _archive(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.log.archive import run_archiver

    stop = stop_on_signals()
    rows = run_archiver(cfg, stop, flush_s=args.flush_s, segment_records=args.segment_records)
    print(f"archived {rows} records into {cfg.run_path / 'archive'}")
    return 0


def _sessions(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.producers.sessions.server import serve_sessions

    serve_sessions(cfg)
    return 0


COMMANDS = {
    "run": (_run, "start broker, Redis, processor, rollout and trainer; train; write summary.json"),
    "rollout": (_rollout, "run a rollout worker (engine + async sampling)"),
    "process": (_process, "run a stream processor (any number share the work: one consumer group)"),
    "train": (_train, "run the trainer"),
    "teacher": (_teacher, "on-policy distillation: score every rollout trajectory on the teacher (distill.teacher_path "
                          "or teacher_url) onto rollout.teacher_logprobs"),
    "sft": (_sft, "supervised fine-tuning on a data set (no rollout, no broker)"),
    "load-prompts": (_load_prompts, "publish the data set's prompts on the prompts topic (--follow: keep feeding)"),
    "metrics": (_metrics, "live terminal view of a running job from its topics (of a finished run: its last figures, "
                          "from its archive); --serve: the live run page and "
                          "the Prometheus endpoint of every figure; --jsonl PATH: log buffer.metrics"),
    "track": (_track, "write the run to TensorBoard, W&B (offline by default) and MLflow, as observe.* or the flags "
                      "say, each writer resuming from its own committed position; --from-archive RUN: an old run"),
    "plot": (plot, "PNG plots (reward, staleness, queue, throughput, drops) of a run, archived or live"),
    "audit": (audit, "exactly-once audit of a finished run from its archive and last checkpoint"),
    "verify-weights": (_verify_weights, "check every ack on weights.applied against weights.versions (metric + log)"),
    "eval": (_eval, "evaluate each due weight version on held-out prompts (eval.mode dedicated or external) "
                    "onto eval.results"),
    "engine": (_engine, "serve the CPU engine over SGLang's HTTP API (/generate, pause, update weights)"),
    "serve-vllm": (_serve_vllm, "serve the policy on vLLM's CPU build (rollout.engine vllm; `milestream run` starts "
                                "one per rollout worker): vLLM's OpenAI server with its RL routes"),
    "router": (_router, "route each session's requests to one engine (router.engines; X-SMG-Routing-Key)"),
    "topics": (_topics, "list the topics of the run's broker (of a finished run: its archive's, with their message "
                        "counts), or create them"),
    "archive": (_archive, "write every topic to Parquet segments under RUN_DIR/archive (until stopped)"),
    "replay": (replay, "describe an archived run; --republish: put it back into a fresh broker; "
                        "--step N: recompute a trainer step and compare; select by step, group, time or offset "
                        "to --list, --show, --export or --redrive (see observe/debug_cli.py)"),
    "export": (export, "write a trained version (default: the newest kept) of --run-dir as a Hugging Face folder "
                        "--out (LoRA merged; --adapter: the PEFT adapter alone), with its tokenizer"),
    "mismatch": (mismatch, "recompute the trainer's log-probs of chosen logged samples at the versions that "
                            "generated them and compare with the rollout's, token by token: table, top-k KL, plot, "
                            "the first token where they disagree (see observe/mismatch.py)"),
    "fork": (fork, "a new run (--run-dir) whose trainer starts from the state of run --from at --step N and trains "
                    "on its logged groups, in its order, under the knobs --set changes; nothing is generated"),
    "export-rollouts": (export_rollouts, "write the logged trajectories of --run-dir (text, token ids, reward, "
                                          "log-probs, versions, group, step trained) as Parquet into --out"),
    "compare": (compare, "plot runs' step figures (reward, held-out score, loss, KL, clip fraction) side by side "
                          "into one PNG and a table; a fork compares as any run"),
    "sessions": (_sessions, "serve token-in-token-out chat sessions over HTTP (sessions.host:port)"),
}


def _track_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--tensorboard", nargs="?", const="", metavar="DIR",
                         help="TensorBoard event files under DIR/<run name> (default RUN_DIR/tensorboard)")
    command.add_argument("--wandb", choices=["offline", "online"], help="a W&B run (offline: `wandb sync` later)")
    command.add_argument("--mlflow-uri", metavar="URI", help="an MLflow tracking URI; local: RUN_DIR/mlflow.db")
    command.add_argument("--from-archive", metavar="RUN", help="write the archived run in RUN/archive (no broker)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="milestream", description=__doc__, epilog=EXIT_STATUSES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        _common(command, name)
        if name == "rollout":
            command.add_argument("--worker-id", default="worker-0")
        if name == "train":
            command.add_argument("--shadow", action="store_true", help="beside a live run (--config its config.yaml): "
                                 "train on its groups as they arrive under the --set knobs, into --run-dir, publishing "
                                 "no weights and touching none of its buffer's credit")
        if name == "engine":
            command.add_argument("--host", default="127.0.0.1")
            command.add_argument("--port", type=int, default=30001, help="0: a free port (printed when ready)")
            command.add_argument("--engine-id", default="engine-0", help="with --engines N: ENGINE_ID-0 ... -N-1")
            command.add_argument("--engines", type=int, default=1, help="engine processes (each started fresh)")
        if name == "serve-vllm":
            command.add_argument("--host", default="127.0.0.1", help="vLLM's control routes take no token: keep it "
                                 "on loopback")
            command.add_argument("--port", type=int, default=8000)
        if name == "router":
            command.add_argument("--sglang", action="store_true",
                                 help="run sglang-router 0.3.2 (manual policy, min_load) on router.* instead")
        if name == "load-prompts":
            command.add_argument("--start", type=int, default=0)
            command.add_argument("--count", type=int, default=1000)
            command.add_argument("--follow", action="store_true",
                                 help="keep --lookahead prompts ahead of rollout admissions until stopped")
            command.add_argument("--lookahead", type=int, help="default: twice the buffer capacity")
        if name == "metrics":
            command.add_argument("--serve", action="store_true", help="serve the live page and the Prometheus endpoint "
                                 "(no terminal view)")
            command.add_argument("--prometheus-port", type=int, help="the endpoint's port (implies --serve; "
                                 "default 9464, 0: a free one)")
            command.add_argument("--prometheus-addr", default="127.0.0.1", help="0.0.0.0: scraped from other hosts")
            command.add_argument("--jsonl", help="append each buffer.metrics record to this JSONL file (resumes)")
            command.add_argument("--once", action="store_true", help="print one snapshot of the view and exit")
        if name == "track":
            _track_arguments(command)
        if name == "plot":
            command.add_argument("--source", choices=["auto", "archive", "topics"], default="auto",
                                 help="auto: RUN_DIR/archive when there is one, else the live topics")
            command.add_argument("--out", help="folder for the PNGs (default RUN_DIR/plots)")
        if name == "topics":
            command.add_argument("action", choices=["create", "list"])
        if name == "archive":
            command.add_argument("--flush-s", type=float, default=1.0,
                                 help="the oldest unflushed record is at most this old (the loss bound)")
            command.add_argument("--segment-records", type=int, default=10_000)
        if name == "export":
            command.add_argument("--out", required=True, help="the folder to write (new, or empty)")
            command.add_argument("--version", type=int, help="the weight version (default: the newest kept)")
            command.add_argument("--adapter", action="store_true", help="the LoRA adapter alone, not merged")
        if name == "replay":
            replay_arguments(command)
        if name == "mismatch":
            mismatch_arguments(command)
        if name == "export-rollouts":
            command.add_argument("--out", required=True, help="the folder to write (new, or empty)")
            command.add_argument("--steps", help="A:B or N: the groups these trainer steps trained")
            command.add_argument("--min-reward", type=float, help="the samples whose reward is at least this")
        if name == "compare":
            command.add_argument("runs", nargs="+", metavar="RUN_DIR", help="the runs' folders (each with its archive)")
            command.add_argument("--out", default="compare", help="the folder for compare.png and compare.md")
        if name == "fork":
            command.add_argument("--from", dest="origin", required=True, metavar="RUN_DIR", help="the run to fork")
            command.add_argument("--step", type=int, required=True, help="fork after this step of it (0: its start)")
            command.add_argument("--steps", type=int, help="steps of the fork (default: the original's remaining)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return COMMANDS[args.command][0](build_config(args), args)
    except UserError as exc:  # its message is the whole story; any other exception is a bug: its traceback prints
        if args.debug:
            traceback.print_exc()
        print(f"milestream {args.command}: {exc}", file=sys.stderr)
        return USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
