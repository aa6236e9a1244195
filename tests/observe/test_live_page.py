"""The live run page in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
selenium) opens it while a short run goes. With the trainer held after its first step, the page shows step 1
with its charts filled in and a decoded trajectory; the metrics stage serving it is SIGKILLed and started
again by the run; the page, never reloaded, follows the run to its last step. Every wait polls the DOM, with
a generous limit that only guards against a hang.

Without chromium this test skips, except under CI (CI=true), where scripts/setup installs it: there it fails."""
from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path

import pytest
from milestream_testkit.chaos import sigkill, stage_pids
from holds import Holds
from stage_runs import print_logs_unless_done, running, start_run, wait_for

HANG_S = 240


def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        missing = "chromium and chromedriver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs {missing}: scripts/setup installs them")
        pytest.skip(f"needs {missing}")
    options = Options()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-crash-reporter", "--disable-breakpad", "--window-size=1400,1100"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver), options=options)


def answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "api/run", timeout=5).status == 200
    except OSError:
        return False


def page_figures(driver) -> dict:
    """What the page shows now: the step, the points of each chart's series, trajectories and their tokens."""
    return driver.execute_script("""
        const n = id => Object.fromEntries([...document.querySelectorAll(`#${id} polyline`)]
            .map(p => [p.dataset.series, +p.dataset.n]));
        return {step: +document.getElementById("step").textContent, status: document.getElementById("status").textContent,
                reward: n("chart-reward"), staleness: n("chart-staleness"), buffer: n("chart-buffer"),
                versions: n("chart-versions"), trajectories: document.querySelectorAll(".traj").length,
                tokens: document.querySelectorAll(".traj .tokens span").length, marker: window.notReloaded === true};
    """)


def shows(driver, what: str, condition) -> None:
    """Wait until the page's figures meet ``condition``; a hang fails naming what the page showed."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, HANG_S, poll_frequency=0.5).until(lambda d: condition(page_figures(d)))
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}: {page_figures(driver)}") from None


def test_live_page_fills_in_and_follows_the_run_across_a_metrics_stage_restart(cfg, tmp_path, monkeypatch):
    driver = chromium()
    cfg = cfg.with_overrides(trainer={"steps": 3})
    run_dir = Path(cfg.run.run_dir)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected", at_pass=2)  # step 1 published, step 2 not yet
    holds.arm("trainer.published", at_pass=cfg.trainer.steps)  # the run (and the page's server) goes on meanwhile
    runner, outcome = start_run(cfg)
    try:
        wait_for(lambda: (run_dir / "page.url").exists(), HANG_S, "the page's address", runner)
        url = (run_dir / "page.url").read_text().strip()
        wait_for(lambda: answers(url), HANG_S, "the metrics stage to serve the page", runner)
        driver.get(url)
        driver.execute_script("window.notReloaded = true")
        shows(driver, "step 1 with its figures", lambda f: f["step"] == 1 and f["reward"].get("reward (mean)") == 1
              and f["buffer"].get("queued", 0) >= 2 and f["trajectories"] >= 1)
        trainer = holds.wait_held("trainer.collected", HANG_S, running(runner, "the trainer held after step 1"))
        first = page_figures(driver)
        assert first["status"] == "live" and first["staleness"]["mean"] == 1 and first["tokens"] >= 1, first
        assert first["versions"]["published"] == 1, first

        (metrics,) = stage_pids(run_dir / "config.yaml", "metrics")
        sigkill(metrics)
        wait_for(lambda: [p for p in stage_pids(run_dir / "config.yaml", "metrics") if p != metrics], HANG_S,
                 "the metrics stage started again", runner)
        holds.release("trainer.collected", trainer)
        trainer = holds.wait_held("trainer.published", HANG_S, running(runner, "the trainer held at its last step"))
        shows(driver, "the last step", lambda f: f["step"] == cfg.trainer.steps
              and f["reward"].get("reward (mean)") == cfg.trainer.steps)
        last = page_figures(driver)
        assert last["marker"] and last["status"] == "live", last  # the same page, never reloaded
        assert last["staleness"]["mean"] == cfg.trainer.steps and last["versions"]["published"] >= 2, last
        holds.release("trainer.published", trainer)
        runner.join(HANG_S)
    finally:
        driver.quit()
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    assert (run_dir / "logs" / "metrics.log").read_text().count("==== life") == 2
