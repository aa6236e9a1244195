"""Hold points for the engine tests: an engine can be held between two of its steps."""
from __future__ import annotations

import pytest

from holds import Holds


@pytest.fixture
def holds(monkeypatch, tmp_path) -> Holds:
    return Holds.enable(monkeypatch, tmp_path)
