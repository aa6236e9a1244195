"""`milestream mismatch` on a finished run: a short real run with rollout.true_on_policy and the engine's
top-k logged, then one logged log-prob planted off by a little in the archive. The command names exactly
that token; every other sample agrees with the trainer bit for bit, from the archive and from the broker."""
from __future__ import annotations

import dataclasses
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stage_runs import run_showing_logs

from milestream.cli import main
from milestream.log.archive import ROW_SCHEMA, segment_paths
from milestream.log.reader import ArchiveSource
from milestream.observe.debug_cli import text_decoder
from milestream.observe.mismatch import comparable, compare
from milestream.observe.selection import sample_table
from milestream.schemas import topics
from milestream.schemas.codec import decode, encode
from milestream.schemas.records import LogProbs

PLANTED_AT = 2  # the response position whose logged log-prob is moved
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def finished(cfg):
    """A two-step run (the conftest's tiny settings) whose archive and weight versions are kept."""
    cfg = cfg.with_overrides(rollout={"true_on_policy": True, "logprobs_topk": 3},
                             trainer={"steps": 2, "keep_weight_versions": 10}, run={"max_wall_s": 180})
    summary = run_showing_logs(cfg)
    assert summary["steps"] == cfg.trainer.steps
    return cfg


def plant(run_dir, trajectory_id: str, position: int, delta: float) -> float:
    """Move one archived rollout log-prob by ``delta`` (its record re-encoded in place); the new value."""
    for path in segment_paths(run_dir, topics.LOGPROBS.name):
        rows = pq.read_table(path, schema=ROW_SCHEMA).to_pylist()
        for row in rows:
            records = decode(row["value"], LogProbs)
            target = next((r for r in records if r.trajectory_id == trajectory_id), None)
            if target is not None:
                moved = list(target.logprobs)
                moved[position] += delta
                row["value"] = encode([dataclasses.replace(r, logprobs=moved) if r is target else r for r in records])
                pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), path)
                return moved[position]
    raise AssertionError(f"{trajectory_id} is not archived")


def test_the_planted_token_is_named_and_nothing_else_disagrees(finished, capsys):
    cfg = finished
    # from the broker, before anything is planted: true on-policy, so no difference at all
    assert main(["mismatch", "--run-dir", str(cfg.run_path), "--from-broker", "--worst", "2"]) == 0
    assert "2 samples compared, 0 disagree" in capsys.readouterr().out

    rows = comparable(sample_table(ArchiveSource(cfg.run_path), text_decoder(cfg))).to_pylist()
    trained = [r for r in rows if r["outcome"] == "trained" and r["num_response_tokens"] > PLANTED_AT]
    victim = trained[len(trained) // 2]
    moved = plant(cfg.run_path, victim["trajectory_id"], PLANTED_AT, 0.03125)

    out = cfg.run_path / "mismatch.png"
    code = main(["mismatch", "--run-dir", str(cfg.run_path), "--trajectory", victim["trajectory_id"],
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    (summary,) = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    token = victim["response_tokens"][PLANTED_AT]
    assert summary["first_disagreement"] == {
        "position": PLANTED_AT, "token_id": victim["response_ids"][PLANTED_AT], "token": token,
        "version": victim["token_versions"][PLANTED_AT], "rollout": moved, "trainer": victim["logprobs"][PLANTED_AT],
        "diff": victim["logprobs"][PLANTED_AT] - moved, "topk_gap": 0.0}
    assert f"first disagreement at position {PLANTED_AT}" in printed
    assert all(word in printed for word in ("rollout", "trainer", "top-k", "KL"))  # the table's header
    # piped, the table's numbers are whole: the planted token's row holds both log-probs to six places
    assert re.search(rf"{moved:.6f} │ {victim['logprobs'][PLANTED_AT]:.6f} │", printed), printed
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 10_000

    # every sample of the run against the trainer, each at the versions of its tokens: only the planted
    # token differs, the top-k too agree exactly (its KL is 0)
    every = compare(cfg, comparable(sample_table(ArchiveSource(cfg.run_path), text_decoder(cfg))).to_pylist())
    # the samples span two versions or more (which ones depends on when each version reached the engine)
    assert len(every) == len(rows) and len({v for r in rows for v in r["token_versions"]}) >= 2
    differing = [(c.trajectory_id, t.position) for c in every for t in c.tokens if t.diff != 0]
    assert differing == [(victim["trajectory_id"], PLANTED_AT)]
    assert all(t.kl_topk == 0.0 and t.topk_gap == 0.0 for c in every for t in c.tokens)
    # judged as a run without true on-policy: a gap is expected, the summary says how large and how to have
    # none, and only a --tolerance given makes the exit status judge it
    loose = ["mismatch", "--run-dir", str(cfg.run_path), "--trajectory", victim["trajectory_id"], "--out", str(out),
             "--set", "rollout.true_on_policy=false"]
    assert main(loose) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "this run had rollout.true_on_policy off" in said and "about 0.04 nats a token on average" in said
    assert "a report, not a check: the exit status is 0" in said and "--set rollout.true_on_policy=true" in said
    assert main([*loose, "--tolerance", "0.01"]) == 1  # the planted 2^-5 is beyond it
    assert "the exit status judges the --tolerance given" in capsys.readouterr().out

    # and the worst sample of the run is the planted one
    assert main(["mismatch", "--run-dir", str(cfg.run_path), "--worst", "1", "--out", str(out)]) == 1
    assert f'"trajectory_id": "{victim["trajectory_id"]}"' in capsys.readouterr().out
