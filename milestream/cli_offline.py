"""The commands that read a run after it ran, or beside it (plot, audit, export, mismatch, replay, fork,
export-rollouts, compare), and how any command builds its Config: from the command line (``build_config``) or
from the run's own RUN_DIR/config.yaml (``run_configuration``, ``finished_run``).

Their own module so that cli.py does not grow past reading; cli.py imports them back for its table of commands
and its parser. The Config helpers live here rather than in cli.py because these commands need them and cli.py
imports this module: the other way round would be an import cycle.
"""
from __future__ import annotations

import argparse

from milestream.config import Config, ConfigError, load_config, run_folder


def build_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.bootstrap_servers:
        overrides.append(f"broker.bootstrap_servers={args.bootstrap_servers}")
    if args.redis_url:
        overrides.append(f"redis.url={args.redis_url}")
    if args.run_dir:
        overrides.append(f"run.run_dir={args.run_dir}")
    from milestream.infra.secret_env import joining

    return joining(load_config(args.config, overrides))  # a stage started by hand gets the run's credentials


def run_configuration(cfg: Config, args: argparse.Namespace) -> Config:
    """For commands that read a run (metrics, plot, replay): the run's own RUN_DIR/config.yaml (its
    broker, topic prefix, model, rules) with this command line's overrides; ``cfg`` itself when
    ``--config`` was given or the folder holds none."""
    saved = cfg.run_path / "config.yaml"
    if args.config or not saved.exists():
        return cfg
    return build_config(argparse.Namespace(**{**vars(args), "config": str(saved)}))


def finished_run(cfg: Config, args: argparse.Namespace) -> Config:
    """For commands that read a run that may be over (replay, plot, mismatch, export, track --from-archive):
    its folder must hold a run (RunFolderError), unless the command reads the live topics alone; then
    ``run_configuration``."""
    if not (getattr(args, "from_broker", False) or getattr(args, "source", None) == "topics"):
        run_folder(cfg.run_path)
    return run_configuration(cfg, args)


def plot(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.observe.plots import plot_run

    for path in plot_run(finished_run(cfg, args), args.source, args.out):
        print(f"wrote {path}")
    return 0


def audit(cfg: Config, args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from milestream.log.audit import audit_run

    audit = audit_run(cfg.run.run_dir)
    print(json.dumps({**dataclasses.asdict(audit), "exact": audit.exact}))
    return 0 if audit.exact else 1


def export(cfg: Config, args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from milestream.train.export import export_version

    exported = export_version(finished_run(cfg, args), args.out, version=args.version, adapter=args.adapter)
    print(json.dumps({k: v for k, v in dataclasses.asdict(exported).items() if k != "checksums"}))
    return 0


def mismatch(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.observe.mismatch import run as run_mismatch

    return run_mismatch(finished_run(cfg, args), args)


def replay(cfg: Config, args: argparse.Namespace) -> int:
    import json

    from milestream.log import restore
    from milestream.observe import debug_cli

    if debug_cli.wants(args):  # select, list, show, export, re-drive
        return debug_cli.run(finished_run(cfg, args), args)
    run_dir = cfg.run.run_dir
    if args.step is not None:
        from milestream.observe.recompute import replay_step

        result = replay_step(finished_run(cfg, args), run_dir, args.step)
        print(json.dumps({"step": result.step, "from_checkpoint": result.from_checkpoint, "logged": result.logged,
                          "replayed": result.replayed, "bitwise_equal": result.bitwise_equal}))
        return 0 if result.bitwise_equal else 1
    if args.resume:
        report, accounting = restore.resume(cfg, run_dir, prefix=args.topic_prefix)
        print(f"reconciled the buffer: {accounting}")
    elif args.republish:
        report = restore.republish(cfg, run_dir, prefix=args.topic_prefix, restore_groups=not args.no_groups)
    else:  # no broker needed: say what the archive holds
        print(json.dumps(restore.describe(run_dir), indent=1))
        return 0
    print(f"republished {sum(report.records.values())} records ({json.dumps(report.records)}); "
          f"restored the offsets of {len(report.groups)} consumer groups: {', '.join(report.groups) or '-'}")
    return 0


def fork(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.evaluate.evaluation import HeldOutOfWeights
    from milestream.observe.fork import fork_run

    if args.config or not args.run_dir:
        raise ConfigError("fork: the fork's knobs are the original's (FROM/config.yaml) with --set; give --run-dir NEW")
    saved = run_folder(args.origin) / "config.yaml"
    original = load_config(saved)
    fork = load_config(saved, [*args.overrides, f"run.run_dir={args.run_dir}"])
    evaluate = HeldOutOfWeights(fork) if fork.eval.mode is not None else None
    try:
        print(f"summary: {fork_run(original, fork, args.origin, args.step, args.steps, evaluate)}")
    finally:
        if evaluate is not None:
            evaluate.close()
    return 0


def export_rollouts(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.observe import rollouts_export
    from milestream.observe.selection import parse_span

    steps = parse_span(args.steps, "--steps") if args.steps else None
    exported = rollouts_export.export_rollouts(finished_run(cfg, args), args.out, steps, args.min_reward)
    print(f"wrote {exported.samples} samples of {exported.groups} groups to {exported.path}")
    return 0


def compare(cfg: Config, args: argparse.Namespace) -> int:
    from milestream.observe.compare import compare_runs

    png, table = compare_runs([run_folder(run) for run in args.runs], args.out)
    print(table + f"wrote {png} and {png.with_suffix('.md')}")
    return 0


def mismatch_arguments(command: argparse.ArgumentParser) -> None:
    pick = command.add_argument_group("which samples (all given must hold); then --worst N of them")
    pick.add_argument("--from-broker", action="store_true", help="read the run's topics on the broker "
                      "(--bootstrap-servers, or the one RUN_DIR/config.yaml names) instead of RUN_DIR/archive")
    pick.add_argument("--trajectory", action="append", default=[], metavar="GROUP/INDEX",
                      help="a sample by its trajectory id (repeatable)")
    pick.add_argument("--group", action="append", default=[], help="the samples of a group (repeatable)")
    pick.add_argument("--steps", help="A:B or N: the samples of the groups these trainer steps trained")
    pick.add_argument("--worst", type=int, metavar="N", help="of those (or of every sample on the log), the N "
                      "with the largest |trainer - rollout| on any token")
    command.add_argument("--tolerance", type=float, help="a disagreement is a difference beyond this (default: "
                         "any difference when the run had rollout.true_on_policy, else 0.1 nats). Exit status 1 on "
                         "a disagreement with true on-policy or with --tolerance given; without either, the gap "
                         "is expected and the status 0")
    command.add_argument("--out", help="the plot's path (default RUN_DIR/plots/mismatch.png)")


def replay_arguments(command: argparse.ArgumentParser) -> None:
    from milestream.observe.debug_cli import add_arguments as add_debugging_arguments

    command.add_argument("--republish", action="store_true",
                         help="produce the archive into the broker at the same offsets, restore group offsets")
    command.add_argument("--resume", action="store_true",
                         help="--republish, then reconcile the buffer's credit in Redis so the run can go on")
    command.add_argument("--topic-prefix", help="republish under this prefix (default: the archived one)")
    command.add_argument("--no-groups", action="store_true", help="do not restore consumer-group offsets")
    command.add_argument("--step", type=int, help="recompute this trainer step from the archived log and the "
                         "checkpoint before it; compare loss and grad norm bit for bit with the logged ones")
    add_debugging_arguments(command)
