"""``milestream metrics``: a live terminal view of a running job, from its topics alone.

Reward, staleness, queue, throughput, drops by reason, weight versions and step time, refreshed as
records arrive; nothing is asked of the stages (the view is one more reader of their topics). Of a run
that is over (no broker answers), one view of its last figures, from its archive.
"""
from __future__ import annotations

import statistics
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from milestream.config import Config
from milestream.observe.feed import TopicFeed, archive_instead, archived, live_topics
from milestream.observe.series import RunSeries

RECENT_STEPS = 10  # the reward is noisy step to step: also show its mean over the last few steps
NONE = "-"


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return NONE if value is None else format(value, spec)


def trainer_rows(series: RunSeries, cfg: Config) -> list[tuple[str, str]]:
    steps = series.trainer_steps()
    if not steps:
        return [("trainer", "no step yet")]
    last = steps[-1].values
    recent = statistics.fmean(m.values.get("reward_mean", 0.0) for m in steps[-RECENT_STEPS:])
    throughput = series.throughput()
    return [
        ("step", f"{steps[-1].step}/{cfg.trainer.steps}  step time {_fmt(last.get('step_s'), '.1f')} s  "
                 f"loss {_fmt(last.get('loss'), '+.4f')}"),
        ("reward", f"{_fmt(last.get('reward_mean'))} last step, {recent:.3f} mean of the last "
                   f"{min(len(steps), RECENT_STEPS)}"),
        ("staleness", f"mean {_fmt(last.get('staleness_mean'), '.2f')}  max {_fmt(last.get('staleness_max'), '.0f')} "
                      f"(bound {cfg.staleness_bound}, {cfg.run.schedule})"),
        ("throughput", f"{throughput[-1][1]:.0f} trained tokens/s" if throughput else NONE),
    ]


def buffer_rows(series: RunSeries, cfg: Config) -> list[tuple[str, str]]:
    queue = series.figure("processor", "queue_size")
    if queue is None and series.steps:
        queue = series.trainer_steps()[-1].values.get("queue_size")
    drops = series.drops_by("reason")
    return [
        ("queue", f"{_fmt(queue, '.0f')} of {cfg.buffer_capacity} groups  "
                  f"partial {_fmt(series.figure('processor', 'partial_groups'), '.0f')}  "
                  f"credit {_fmt(series.figure('processor', 'credit_available'), '.0f')}"),
        ("drops", "  ".join(f"{reason} {count}" for reason, count in sorted(drops.items())) or "none"),
    ]


def rollout_rows(series: RunSeries) -> list[tuple[str, str]]:
    workers = series.sources("rollout")
    rate = sum(m.values.get("samples_per_s", 0.0) for m in workers.values())
    rows = [("rollout", f"{len(workers)} workers, {rate:.2f} samples/s" if workers else NONE)]
    for source, record in workers.items():
        v = record.values
        rows.append((f"  {source.partition('/')[2]}", f"samples {_fmt(v.get('samples'), '.0f')}  "
                     f"inflight {_fmt(v.get('inflight'), '.0f')}  version {_fmt(v.get('engine_version'), '.0f')}"))
    return rows


def weight_rows(series: RunSeries) -> list[tuple[str, str]]:
    latest = series.latest_version()
    if latest is None:
        return [("weights", "no version yet")]
    synced = {engine: seconds for engine, _, seconds in series.sync_seconds()}  # the last per engine
    engines = "  ".join(f"{engine} v{version} ({_fmt(synced.get(engine), '.2f')} s)"
                        for engine, version in sorted(series.engine_versions().items()))
    mismatched = series.figure("verifier", "weights_mismatched")
    return [("weights", f"v{latest.version} ({latest.transport}, {latest.num_bytes / 1e6:.1f} MB)  "
                        f"mismatched {_fmt(mismatched, '.0f')}"),
            ("engines", engines or NONE)]


def render(series: RunSeries, cfg: Config, title: str | None = None) -> Group:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for name, value in (trainer_rows(series, cfg) + buffer_rows(series, cfg) + rollout_rows(series)
                        + weight_rows(series)):
        table.add_row(name, value)
    if title is None:
        age = time.time() - series.first_ts if series.first_ts else 0.0
        prefix = f" (topics {cfg.broker.topic_prefix}*)" if cfg.broker.topic_prefix else ""
        title = f"milestream on {cfg.broker.bootstrap_servers}{prefix}, first record {age:.0f} s ago"
    return Group(Text(title, style="bold"), table)


def watch(cfg: Config, stop: threading.Event, once: bool = False, console: Console | None = None) -> RunSeries:
    """Show the view until ``stop``; ``once``: read what the topics hold, print one snapshot, return. A run that
    is over: one snapshot of its archive, after a line saying so."""
    console = console or Console()
    if not live_topics(cfg):
        console.print(archive_instead(cfg), highlight=False)
        series = RunSeries().observe_all(archived(cfg.run_path))
        console.print(render(series, cfg, f"milestream run {cfg.run.run_dir}, over: its archive"))
        return series
    feed = TopicFeed(cfg, f"{cfg.broker.topic_prefix}live-view")
    series = RunSeries()
    try:
        if once:
            series.observe_all(feed.drain())
            console.print(render(series, cfg))
            return series
        with Live(render(series, cfg), console=console, refresh_per_second=2) as live:
            while not stop.is_set():
                series.observe_all(feed.poll(0.5))
                live.update(render(series, cfg))
    finally:
        feed.close()
    return series
