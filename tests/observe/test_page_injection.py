"""A record's strings reach the live page (observe/page.html) as text, never parsed as HTML: whoever can write
to the broker must not run script in the operator's browser. The page draws the state a real RunPage made
from records whose engine and trajectory ids carry markup, in headless Chromium (skips without it, except
under CI: see test_live_page.py)."""
from __future__ import annotations

from pathlib import Path

from test_live_page import chromium

from milestream.config import Config
from milestream.observe.feed import Observed
from milestream.observe.page import PAGE, RunPage
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import Trajectory, WeightApplied

MARKUP = '<img src=x onerror="window.injected = true"><b id=injected>'
HTML_SINKS = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "createContextualFragment")


def hostile_state(tmp_path: Path) -> dict:
    cfg = Config().with_overrides(run={"run_dir": str(tmp_path / "run")}, model={"path": str(tmp_path / "no-model")})
    page = RunPage(cfg)  # (no tokenizer loads: the tokens show as ids)
    trajectory = Trajectory(
        trajectory_id=f"trajectory{MARKUP}", group_id="g", prompt_id="p", sample_index=0, group_size=1,
        prompt_ids=[1], response_ids=[2], loss_mask=[1], token_versions=[0], reward=1.0, status="completed",
        response_text=MARKUP, engine_id=f"engine{MARKUP}", worker_id="w", submitted_at=0.0, finished_at=1.0)
    ack = WeightApplied(engine_id=f"engine{MARKUP}", version=1, tensor_names=[], checksums=[], ok=True, detail="",
                        ts=1.0)
    for offset, (spec, record) in enumerate([(topics.TRAJECTORIES, trajectory), (topics.WEIGHTS_APPLIED, ack)]):
        page.observe(Observed(spec, Position(spec.name, 0, offset), record))
    return page.state()


def test_the_page_never_parses_a_string_as_html() -> None:
    script = PAGE.read_text()
    assert [sink for sink in HTML_SINKS if sink in script] == []


def test_markup_in_a_records_ids_shows_as_text_and_runs_nothing(tmp_path: Path) -> None:
    state = hostile_state(tmp_path)
    driver = chromium()
    try:
        driver.get(PAGE.as_uri())
        shown = driver.execute_script("""
            render(arguments[0]);
            return {made: document.querySelectorAll("img, #injected").length, ran: window.injected === true,
                    trajectory: document.querySelector(".traj").textContent,
                    engines: document.getElementById("engines").textContent};
        """, state)
    finally:
        driver.quit()
    assert shown["made"] == 0 and not shown["ran"], shown  # no element made from a record's string
    assert f"engine{MARKUP}" in shown["trajectory"] and f"trajectory{MARKUP}" in shown["trajectory"], shown
    assert f"engine{MARKUP}" in shown["engines"], shown
