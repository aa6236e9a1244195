"""The weak sandbox (sandbox.allow_weak, where bubblewrap cannot isolate a call): never for a worker running
as root, where ``unshare -r`` maps tool code to host root (it could signal the worker and write into the
virtual environment); for another user it runs tools, with a warning and the sandbox_weak figure."""
from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

import pytest

from milestream.producers.environments import sandbox as sandbox_module
from milestream.producers.environments.sandbox import Sandbox, SandboxUnavailable

AS_ROOT = os.geteuid() == 0


@pytest.fixture
def missing_bwrap(monkeypatch) -> str:
    monkeypatch.setattr(sandbox_module, "_weak_used", threading.Event())  # this test's figure only
    return f"/nonexistent/bwrap-{uuid.uuid4().hex}"


@pytest.mark.skipif(not AS_ROOT, reason="the refusal is for a worker running as root")
def test_as_root_the_weak_sandbox_refuses_before_any_tool_code_runs(missing_bwrap: str, tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="not installed.*sandbox.allow_weak does not apply to a worker "
                                                 "running as root.*unprivileged user"):
        with Sandbox(bwrap=missing_bwrap, allow_weak=True) as sandbox:
            sandbox.run_python(f"open({str(tmp_path / 'reached')!r}, 'w').write('tool code ran as root')")
    assert not (tmp_path / "reached").exists() and sandbox_module.figures() == {}


@pytest.mark.skipif(AS_ROOT, reason="as root the weak sandbox refuses (the test above)")
def test_for_an_unprivileged_worker_the_weak_sandbox_runs_tools_with_a_warning(missing_bwrap: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=sandbox_module.__name__), \
            Sandbox(bwrap=missing_bwrap, allow_weak=True) as sandbox:
        assert sandbox.weak and sandbox.run_python("print(6 * 7)").stdout == "42\n"
    assert any("WEAK sandbox" in r.getMessage() and missing_bwrap in r.getMessage() for r in caplog.records)
    assert sandbox_module.figures() == {"sandbox_weak": 1.0}
