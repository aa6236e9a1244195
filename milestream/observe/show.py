"""One trajectory, readably: who made it, what became of its group, its decoded text, and its tokens.

Takes a row of ``selection.sample_table`` (so it shows the same thing the Parquet export holds).
Text from the log is printed as ``rich.text.Text``, never as markup: a response may contain
``[/answer]`` or other bracketed text that rich would otherwise interpret.
"""
from __future__ import annotations

import datetime
import math
from typing import Any

import pyarrow as pa
from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


PIPED_WIDTH = 400  # columns of a console that is no terminal: a table takes its natural width, no number cut


def table_console() -> Console:
    """The terminal's console; piped or redirected, one wide enough that no table cuts a cell (rich would fit
    every table into 80 columns, eliding numbers)."""
    console = Console()
    return console if console.is_terminal else Console(width=PIPED_WIDTH)


def when(timestamp_ms: int | None) -> str:
    """A broker timestamp in local time, to the millisecond ("-": none)."""
    if not timestamp_ms or timestamp_ms < 0:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp_ms / 1000).isoformat(sep=" ", timespec="milliseconds")


def _fate(row: dict[str, Any]) -> str:
    if row["outcome"] == "trained":
        return f"trained at step {row['step']} (staleness {row['staleness']})"
    if row["outcome"] == "dropped":
        return f"dropped by the {row['dropped_by']}: {row['drop_reason']} ({row['drop_detail']})"
    if row["outcome"] == "buffered":
        return "emitted to buffer.groups, not trained when the run stopped"
    return "pending: the processor had not completed its group"


def header(row: dict[str, Any]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    emitted = ("-" if row["group_offset"] is None
               else f"buffer.groups[{row['group_partition']}]@{row['group_offset']}")
    for name, value in (
        ("group", f"{row['group_id']}  (sample {row['sample_index']} of {row['group_size']})"),
        ("outcome", _fate(row)),
        ("reward", f"{row['reward']:.3f}  status {row['status']}"),
        ("versions", f"{row['min_version']}..{row['max_version']}"),
        ("engine", f"{row['engine_id']} on {row['worker_id']}"),
        ("logged", f"rollout.trajectories[{row['partition']}]@{row['offset']} at {when(row['timestamp_ms'])}; "
                   f"{emitted}"),
    ):
        grid.add_row(name, Text(str(value)))
    return grid


def token_table(row: dict[str, Any]) -> Table:
    table = Table(title="response tokens", title_justify="left", show_edge=False, pad_edge=False)
    for name, justify in (("#", "right"), ("id", "right"), ("token", "left"), ("log-prob", "right"),
                          ("p", "right"), ("version", "right"), ("mask", "right")):
        table.add_column(name, justify=justify)
    logprobs = row["logprobs"] or [None] * row["num_response_tokens"]
    for index, (token_id, token, logprob, version, mask) in enumerate(zip(
            row["response_ids"], row["response_tokens"], logprobs, row["token_versions"], row["loss_mask"])):
        lp = "-" if logprob is None else f"{logprob:.4f}"
        p = "-" if logprob is None else f"{math.exp(logprob):.3f}"
        table.add_row(str(index), str(token_id), Text(repr(token)), lp, p, str(version), str(mask),
                      style=None if mask else "dim")
    return table


def render(row: dict[str, Any]) -> Panel:
    body = Group(header(row), Panel(Text(row["prompt_text"]), title="prompt", title_align="left"),
                 Panel(Text(row["response_text"]), title="response", title_align="left"), token_table(row))
    return Panel(body, title=f"trajectory {row['trajectory_id']}", title_align="left")


def print_trajectories(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    for row in rows:
        console.print(render(row))


def print_groups(summary: pa.Table, console: Console | None = None) -> None:
    """The selected groups (``debug_cli.group_summary``), one line each, oldest first; fits 80 columns."""
    table = Table(title=f"{summary.num_rows} groups", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("group", no_wrap=True)
    for name in ("outcome", "step", "stale", "drop", "n", "reward", "first at"):
        table.add_column(name, justify="left" if name in ("outcome", "drop") else "right")
    for row in summary.to_pylist():
        first_at = datetime.datetime.fromtimestamp(row["timestamp_ms_min"] / 1000).strftime("%H:%M:%S")
        table.add_row(Text(row["group_id"]), row["outcome"], _or_dash(row["step"]), _or_dash(row["staleness"]),
                      _or_dash(row["drop_reason"]), str(row["sample_index_count"]), f"{row['reward_mean']:.3f}",
                      first_at)
    (console or table_console()).print(table)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
