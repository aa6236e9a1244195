"""``milestream mismatch``: logged rollout log-probs against the trainer's, token by token.

For the chosen samples of a logged run (the archive, or the topics of a live broker: log/reader.py;
each sample with its group's fate: observe/selection.py), the trainer's forward (the ``local``
backend's, with ``rollout.true_on_policy`` its exact numerics) recomputes every response token's
log-prob at the weight version that generated that token, loaded from the versions the run folder
keeps (train/export.py: version files, else checkpoints; version 0 is the initial weights; a sample
needing a pruned version is left out, named), and compares it with the log-prob the engine logged on
``rollout.logprobs``:

- a table per sample: position, token, version, rollout log-prob, trainer log-prob, their difference
  (trainer - rollout) and, where the engine logged its top-k (``rollout.logprobs_topk``), the
  largest difference over the engine's k tokens (top-k gap) and the KL from the engine's
  distribution to the trainer's over them (both renormalised on them: the support they share);
- the first token where the two disagree: any difference at all (``!=``) when the run had true
  on-policy on, else one beyond ``tolerance``, in the token's log-prob or in any of its top-k's;
- a plot: both log-probs along each sample, and |difference| and KL under them.

Tokens outside the loss mask (tool output a policy did not write) are shown but not judged. MoE
routing is not replayed: the forward routes afresh.

Exit status: with true on-policy the comparison is a check, 1 when any chosen sample disagrees at all.
Without it the engine and the trainer compute log-probs differently and a gap is expected (the summary
says how large, here and on the default run, and how to have none): a report, 0, unless ``--tolerance``
is given, which makes it a check against that tolerance. A piped table prints every number whole.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from milestream.config import Config
from milestream.infra.model import configure_process, load_trainable_state_dict, trainable_state_dict
from milestream.log.reader import ArchiveSource, BrokerSource, LogSource
from milestream.observe.debug_cli import text_decoder
from milestream.observe.selection import Selection, SelectionError, parse_span, sample_table
from milestream.observe.show import table_console
from milestream.train.backends.base import compute_context
from milestream.train.backends.local import LocalBackend
from milestream.train.export import VersionNotKept, kept_versions, version_tensors
from milestream.train.logprobs import shared_prompt_distributions

DEFAULT_TOLERANCE = 0.1  # nats, without true on-policy: a 10% probability ratio
# measured on the default run without true on-policy (docs/observing.md, "The rollout-train mismatch")
EXPECTED_GAP = "the default run's: about 0.04 nats a token on average, single tokens up to 0.3"
MAX_PLOTTED = 6  # samples in the plot


@dataclass(frozen=True)
class TokenComparison:
    position: int
    token_id: int
    text: str
    version: int
    judged: bool  # in the loss mask
    rollout: float
    trainer: float
    topk_gap: float | None  # max |trainer - rollout| over the engine's top-k tokens (None: none logged)
    kl_topk: float | None  # KL(engine || trainer) over the engine's top-k tokens, both renormalised

    @property
    def diff(self) -> float:
        return self.trainer - self.rollout

    def agrees(self, tolerance: float) -> bool:
        """Within ``tolerance`` in its own log-prob and its top-k's (0: equal); a nan never agrees."""
        gaps = [abs(self.diff)] + ([self.topk_gap] if self.topk_gap is not None else [])
        return all(gap <= tolerance for gap in gaps)


@dataclass(frozen=True)
class SampleComparison:
    trajectory_id: str
    outcome: str  # its group's fate: trained / dropped / buffered / pending
    step: int | None
    tokens: list[TokenComparison]
    tolerance: float

    @property
    def first(self) -> TokenComparison | None:
        """The first judged token where rollout and trainer disagree."""
        return next((t for t in self.tokens if t.judged and not t.agrees(self.tolerance)), None)

    def worst(self) -> float:
        judged = [abs(t.diff) for t in self.tokens if t.judged]
        return max(judged, default=0.0) if all(map(math.isfinite, judged)) else math.inf

    def summary(self) -> dict[str, Any]:
        judged = [t for t in self.tokens if t.judged]
        kls = [t.kl_topk for t in judged if t.kl_topk is not None]
        first = self.first
        return {"trajectory_id": self.trajectory_id, "outcome": self.outcome, "step": self.step,
                "tokens": len(judged), "tolerance": self.tolerance, "max_abs_diff": self.worst(),
                "mean_abs_diff": sum(abs(t.diff) for t in judged) / max(len(judged), 1),
                "kl_topk_mean": sum(kls) / len(kls) if kls else None,
                "first_disagreement": None if first is None else {
                    "position": first.position, "token_id": first.token_id, "token": first.text,
                    "version": first.version, "rollout": first.rollout, "trainer": first.trainer, "diff": first.diff,
                    "topk_gap": first.topk_gap}}


class TrainerLogprobs:
    """The trainer's forward at the run's kept weight versions, each loaded when first asked for."""

    def __init__(self, cfg: Config):
        configure_process(cfg.model)
        self.cfg = cfg.with_overrides(trainer={"backend": "local"})
        self.backend = LocalBackend(self.cfg)
        self.initial = {name: t.clone() for name, t in trainable_state_dict(self.backend.model).items()}
        self.version = 0

    def at(self, version: int) -> "TrainerLogprobs":
        if version != self.version:
            load_trainable_state_dict(self.backend.model, self._tensors(version))
            self.version = version
        return self

    def _tensors(self, version: int) -> dict[str, torch.Tensor]:
        try:
            return version_tensors(self.cfg, version)[3]
        except VersionNotKept:
            if version == 0:  # never written (no noise check): the weights the trainer started from
                return self.initial
            raise

    def distributions(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
        """[T, V] the vocabulary's log-probs at each response position, as the trainer computes them."""
        with torch.no_grad(), compute_context(self.cfg.model, self.backend.device):
            return shared_prompt_distributions(self.backend.model, prompt_ids, [response_ids],
                                               self.cfg.rollout.temperature)[0]


def comparable(table: pa.Table) -> pa.Table:
    """The samples with a logged log-prob for every response token, and a top-k for every one or none."""
    tokens = table["num_response_tokens"]
    logged = pc.fill_null(pc.equal(pc.list_value_length(table["logprobs"]), tokens), False)
    topk = pc.fill_null(pc.list_value_length(table["topk_ids"]), 0)
    return table.filter(pc.and_(logged, pc.or_(pc.equal(topk, 0), pc.equal(topk, tokens))))


def compare(cfg: Config, samples: Sequence[dict[str, Any]], tolerance: float | None = None) -> list[SampleComparison]:
    """Each sample (a row of ``selection.sample_table``) against the trainer; ``tolerance`` None: 0 (exact)
    with rollout.true_on_policy, else DEFAULT_TOLERANCE."""
    if tolerance is None:
        tolerance = 0.0 if cfg.rollout.true_on_policy else DEFAULT_TOLERANCE
    trainer = TrainerLogprobs(cfg)
    found: dict[tuple[str, int], TokenComparison] = {}
    for version in sorted({v for row in samples for v in row["token_versions"]}):
        for row in samples:
            positions = [t for t, v in enumerate(row["token_versions"]) if v == version]
            if positions:
                dist = trainer.at(version).distributions(row["prompt_ids"], row["response_ids"])
                found.update({(row["trajectory_id"], t): _token(row, t, dist[t]) for t in positions})
    return [SampleComparison(row["trajectory_id"], row["outcome"], row["step"],
                             [found[(row["trajectory_id"], t)] for t in range(row["num_response_tokens"])], tolerance)
            for row in samples]


def _token(row: dict[str, Any], t: int, dist: torch.Tensor) -> TokenComparison:
    token = row["response_ids"][t]
    topk_gap = kl = None
    ids = row["topk_ids"][t] if row["topk_ids"] else None
    if ids:
        engine = torch.tensor(row["topk_logprobs"][t], dtype=torch.float32)
        mine = dist[torch.tensor(ids)]
        topk_gap = float((mine - engine).abs().max())
        p, q = (torch.log_softmax(x.double(), dim=-1) for x in (engine, mine))
        kl = float((p.exp() * (p - q)).sum())
    return TokenComparison(t, token, row["response_tokens"][t], row["token_versions"][t], bool(row["loss_mask"][t]),
                           row["logprobs"][t], float(dist[token]), topk_gap, kl)


def worst(comparisons: Sequence[SampleComparison], count: int) -> list[SampleComparison]:
    """The ``count`` samples with the largest |trainer - rollout| on any judged token."""
    return sorted(comparisons, key=lambda c: c.worst(), reverse=True)[:count]


def token_table(comparison: SampleComparison) -> Table:
    first = comparison.first
    where = f"step {comparison.step}" if comparison.step is not None else comparison.outcome
    verdict = ("no disagreement" if first is None else
               f"first disagreement at position {first.position}, token {first.text!r} (id {first.token_id})")
    rule = "exact" if comparison.tolerance == 0 else f"tolerance {comparison.tolerance:g}"
    table = Table(title=Text(f"{comparison.trajectory_id} ({where}): {verdict} [{rule}]"), title_justify="left",
                  show_edge=False, pad_edge=False)
    for name in ("#", "token", "id", "version", "rollout lp", "trainer lp", "diff", "top-k gap", "KL top-k"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for t in comparison.tokens:
        style = "bold red" if t is first else None if t.judged else "dim"
        table.add_row(str(t.position), Text(repr(t.text)), str(t.token_id), str(t.version), f"{t.rollout:.6f}",
                      f"{t.trainer:.6f}", f"{t.diff:.3g}", *(_or_dash(t.topk_gap), _or_dash(t.kl_topk)), style=style)
    return table


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def print_tables(comparisons: Sequence[SampleComparison], console: Console | None = None) -> None:
    console = console or table_console()
    for comparison in comparisons:
        console.print(token_table(comparison))


def plot(comparisons: Sequence[SampleComparison], path: str | Path) -> Path:
    """Per sample (the first MAX_PLOTTED): both log-probs along the response, and under them |diff| and
    the top-k KL, the first disagreement marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(comparisons[:MAX_PLOTTED])
    fig, axes = plt.subplots(max(len(shown), 1), 2, figsize=(11, 2.6 * max(len(shown), 1)), squeeze=False)
    for (left, right), comparison in zip(axes, shown):
        x = [t.position for t in comparison.tokens]
        left.plot(x, [t.rollout for t in comparison.tokens], marker="o", ms=3, label="rollout (engine)")
        left.plot(x, [t.trainer for t in comparison.tokens], marker="x", ms=4, linestyle="--", label="trainer")
        right.bar(x, [abs(t.diff) for t in comparison.tokens], label="|trainer - rollout|")
        kls = [(t.position, t.kl_topk) for t in comparison.tokens if t.kl_topk is not None]
        if kls:
            right.plot([p for p, _ in kls], [k for _, k in kls], color="C3", marker=".", label="KL over top-k")
        if comparison.tolerance:
            right.axhline(comparison.tolerance, color="grey", linestyle="--", label="tolerance")
        first = comparison.first
        for ax in (left, right):
            if first is not None:
                ax.axvline(first.position, color="C3", alpha=0.5, linestyle=":", label="first disagreement")
            ax.grid(alpha=0.3)
            ax.set_xlabel("response position")
        left.set(ylabel="log-prob", title=comparison.trajectory_id)
        right.set(title="difference", ylabel="nats")
        left.legend(loc="best", fontsize="small")
        right.legend(loc="best", fontsize="small")
    if not shown:
        axes[0][0].text(0.5, 0.5, "no sample chosen", ha="center", va="center", transform=axes[0][0].transAxes)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(cfg: Config, args: argparse.Namespace) -> int:
    """``cfg``: the run's configuration (cli.finished_run). Exit status 1 when a chosen sample disagrees and
    the comparison is a check: the run had true on-policy (any difference disagrees), or ``--tolerance`` was
    given. Without either it is a report, 0: the two compute log-probs differently, a gap is expected."""
    chosen = _with_kept_versions(cfg, _chosen(cfg, args))
    comparisons = compare(cfg, chosen, args.tolerance)
    if args.worst is not None:
        comparisons = worst(comparisons, args.worst)
    print_tables(comparisons)
    for comparison in comparisons:
        print(json.dumps(comparison.summary()))
    path = plot(comparisons, args.out or cfg.run_path / "plots" / "mismatch.png")
    disagreeing = sum(c.first is not None for c in comparisons)
    print(f"{len(comparisons)} samples compared, {disagreeing} disagree; wrote {path}")
    if cfg.rollout.true_on_policy:
        return 1 if disagreeing else 0
    print(expected_gap(comparisons, judged=args.tolerance is not None))
    return 1 if disagreeing and args.tolerance is not None else 0


def expected_gap(comparisons: Sequence[SampleComparison], judged: bool) -> str:
    """Why a run without true on-policy disagrees, by how much here, and how to have none."""
    gaps = [abs(t.diff) for c in comparisons for t in c.tokens if t.judged]
    here = f"here {sum(gaps) / max(len(gaps), 1):.3f} nats a token on average, {max(gaps, default=0.0):.3f} at most"
    verdict = ("the exit status judges the --tolerance given" if judged else
               "a report, not a check: the exit status is 0 (give --tolerance to judge)")
    return (f"this run had rollout.true_on_policy off: the engine and the trainer compute log-probs with other "
            f"kernels and batch shapes, so they differ by design ({here}; {EXPECTED_GAP}); {verdict}. For exact "
            "agreement, train with --set rollout.true_on_policy=true: every token then agrees bit for bit and "
            "any difference is a disagreement")


def _chosen(cfg: Config, args: argparse.Namespace) -> list[dict[str, Any]]:
    if not (args.trajectory or args.group or args.steps or args.worst):
        raise SelectionError("choose samples: --trajectory, --group, --steps or --worst N")
    source: LogSource = BrokerSource(cfg) if args.from_broker else ArchiveSource(cfg.run_path)
    picked = Selection(steps=parse_span(args.steps, "--steps") if args.steps else None,
                       group_ids=frozenset(args.group))
    table = comparable(picked.pick(sample_table(source, text_decoder(cfg)), source))
    if args.trajectory:
        table = table.filter(pc.is_in(table["trajectory_id"], pa.array(args.trajectory, pa.string())))
        absent = sorted(set(args.trajectory) - set(table["trajectory_id"].to_pylist()))
        if absent:
            raise SelectionError(f"no sample {absent} with logged log-probs among the selection")
    if table.num_rows == 0:
        raise SelectionError("no sample with logged log-probs matches the selection")
    return table.to_pylist()


def _with_kept_versions(cfg: Config, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose every token's version the run folder still keeps (or version 0); the others are named."""
    kept = {0, *kept_versions(cfg.run.run_dir)}
    out = [row for row in rows if kept.issuperset(row["token_versions"])]
    gone = sorted({v for row in rows for v in row["token_versions"]} - kept)
    if gone:
        message = (f"{len(rows) - len(out)} of the {len(rows)} chosen samples need versions {gone}, no longer kept "
                   f"(kept: {sorted(kept)}; trainer.keep_weight_versions, trainer.keep_checkpoints)")
        if not out:
            raise VersionNotKept(message)
        print(f"milestream mismatch: left out {message}", file=sys.stderr)
    return out
