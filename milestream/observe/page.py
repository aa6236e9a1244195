"""The live run page: one HTML page served by the metrics stage, next to its Prometheus endpoint.

    GET /           the page (page.html: its script and styles inline, charts drawn as SVG; nothing fetched
                    from elsewhere, so it works without a network)
    GET /api/run    what the page shows, as JSON; the page asks for it every second
    GET /metrics    the Prometheus endpoint (observe/prometheus.py)

``RunPage`` is one more observer of the feed (observe/feed.py), plus the tail of rollout.trajectories: reward
and held-out accuracy by step, staleness, queue and credit, drops by reason, weight versions with each
engine's acknowledgement, and the newest trajectories decoded with the weight version of every token. The
stage reads the topics from their beginning, so a restarted stage (or a run resumed from its archive)
serves the whole run again; the page keeps asking through the gap and redraws from what it gets.

Every route only reads, so none asks for the control token; but /api/run carries decoded prompts and
responses, so a request whose Host is not the server's own name (a page rebound to this address by DNS) or
whose Origin is another site's is refused with 403 (engines/http_api.py ``browser_refusal``).
"""
from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from milestream.config import Config
from milestream.engines.http_api import browser_refusal
from milestream.observe.feed import Observed
from milestream.observe.series import RunSeries, evaluated
from milestream.schemas.records import Metrics, Trajectory

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("page.html")
MAX_POINTS = 1500  # per series sent to the page: a long run is thinned, its ends kept
PROMPT_CHARS = 400


def thin(points: list, limit: int = MAX_POINTS) -> list:
    if len(points) <= limit:
        return points
    every = -(-len(points) // limit)
    return points[::every] + ([points[-1]] if (len(points) - 1) % every else [])


class RunPage:
    """An observer keeping what the page shows; ``state`` is its JSON."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.series = RunSeries()
        self.buffer: list[tuple[float, float, float]] = []  # (ts, queue size, credit available): the processor's
        self.trajectories: collections.deque[Trajectory] = collections.deque(maxlen=cfg.observe.page_trajectories)
        self.lock = threading.Lock()  # the feed's thread observes while the server's threads read
        self._tokenizer: Any = None
        self._decoding = threading.Lock()
        self._decoded: dict[str, dict[str, Any]] = {}  # the trajectories shown, by id: decoded once

    def observe(self, item: Observed) -> None:
        record = item.record
        with self.lock:
            if isinstance(record, Trajectory):
                if record.status in ("completed", "truncated"):
                    self.trajectories.append(record)
                return
            self.series.observe(item)
            if isinstance(record, Metrics) and record.source == "processor":
                values = record.values
                if "queue_size" in values and "credit_available" in values:
                    self.buffer.append((record.ts, values["queue_size"], values["credit_available"]))

    def tokenizer(self) -> Any:
        """The policy's tokenizer, loaded at the first trajectory shown; False when it cannot be loaded."""
        if self._tokenizer is None:
            from milestream.infra.model import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.cfg.model)
            except Exception as exc:  # noqa: BLE001 - the page then shows token ids
                log.warning("the live page shows token ids: the tokenizer does not load (%s)", exc)
                self._tokenizer = False
        return self._tokenizer

    def decoded(self, t: Trajectory) -> dict[str, Any]:
        tokenizer = self.tokenizer()
        pieces = [tokenizer.decode([i]) if tokenizer else f"[{i}]" for i in t.response_ids]
        prompt = tokenizer.decode(t.prompt_ids) if tokenizer else " ".join(map(str, t.prompt_ids))
        return {"id": t.trajectory_id, "engine": t.engine_id, "reward": t.reward, "status": t.status,
                "prompt": prompt[-PROMPT_CHARS:], "response": t.response_text,
                "tokens": [[piece, version] for piece, version in zip(pieces, t.token_versions)]}

    def state(self) -> dict[str, Any]:
        with self.lock:
            series, buffer, recent = self.series, list(self.buffer), list(self.trajectories)
            steps = series.trainer_steps()
            since = series.since_start
            out = {
                "run": {"name": self.cfg.run_path.resolve().name, "steps": self.cfg.trainer.steps,
                        "step": steps[-1].step if steps else 0, "schedule": self.cfg.run.schedule,
                        "capacity": self.cfg.buffer_capacity, "staleness_bound": self.cfg.staleness_bound,
                        "now": time.time(), "first_ts": series.first_ts},
                "steps": thin([[m.step, *(m.values.get(k) for k in ("reward_mean", "staleness_mean",
                                                                    "staleness_max", "queue_size", "loss"))]
                               for m in steps]),
                "evals": {name: [[r.step, r.score, r.version] for r in results]
                          for name, results in evaluated(series.evals).items()},
                "buffer": thin([[since(ts), queue, credit] for ts, queue, credit in buffer]),
                "drops": {reason: thin(points) for reason, points in series.drops_over_time().items()},
                "versions": self._versions(series),
            }
        with self._decoding:
            self._decoded = {t.trajectory_id: self._decoded.get(t.trajectory_id) or self.decoded(t) for t in recent}
            out["trajectories"] = [self._decoded[t.trajectory_id] for t in reversed(recent)]
        return out

    @staticmethod
    def _versions(series: RunSeries) -> dict[str, Any]:
        published = sorted((min(times), version) for version, times in series.published.items())
        acks: dict[str, list] = collections.defaultdict(list)
        for ack in sorted(series.acks, key=lambda a: a.ts):
            acks[ack.engine_id].append([series.since_start(ack.ts), ack.version, ack.ok])
        synced = {engine: seconds for engine, _, seconds in series.sync_seconds()}
        latest = series.latest_version()
        return {"published": thin([[series.since_start(ts), version] for ts, version in published]),
                "acks": {engine: thin(points) for engine, points in acks.items()},
                "latest": None if latest is None else {"version": latest.version, "transport": latest.transport,
                                                       "bytes": latest.num_bytes},
                "engines": {engine: {"version": version, "sync_s": synced.get(engine)}
                            for engine, version in sorted(series.engine_versions().items())}}


def serve_http(port: int, addr: str, routes: dict[str, Callable[[], tuple[str, bytes]]]) -> ThreadingHTTPServer:
    """A server answering GET of each route with its (content type, body), in a daemon thread; a request from
    a page of another name or site is refused (``browser_refusal``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            refusal = browser_refusal(self.headers.get("Host"), self.headers.get("Origin"), addr)
            if refusal is not None:
                self.send_error(403, explain=refusal)
                return
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                self.send_error(404)
                return
            content_type, body = route()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # one line per request, every second, says nothing
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def finite(value: Any) -> Any:
    """JSON as a browser parses it: a figure that is nan or infinite becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def page_routes(page: RunPage) -> dict[str, Callable[[], tuple[str, bytes]]]:
    html = PAGE.read_bytes()
    return {"/": lambda: ("text/html; charset=utf-8", html),
            "/api/run": lambda: ("application/json", json.dumps(finite(page.state())).encode())}
