"""The cheapest faust-streaming processor: a baseline for benchmarks/processor.py and benchmarks/data_plane.py.

One faust app (faust-streaming, aiokafka underneath), run as its own process: an agent subscribed to the
source topics with raw key and value serializers takes events in batches (``stream.take_events(BATCH,
within=0.05)``; ``take`` would yield values only, and the key and headers must travel too) and sends each value
on, with its key and headers, through faust's own producer to one output topic. No decoding, no logic: what a
faust processor costs before it does anything.

Settings follow the faust processor milestream ran before the librdkafka one (``faust_settings`` in the git
history of milestream/streams/processor.py): plaintext to the embedded broker, topics created beforehand, earliest offsets,
and aiokafka's fetch wait shortened to ``broker.fetch_wait_ms`` (faust fixes it at 1500 ms, and tansu holds an
empty fetch for a share of it even when data arrives). The producer lingers 5 ms in batches up to 1 MB, as the
processor's librdkafka producer does (aiokafka's own default batch is 16 KB).

    .venv/bin/python benchmarks/faust_forward.py CONFIG OUTPUT_TOPIC SOURCE_TOPIC...   (full topic names)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import faust

from milestream.config import Config, load_config
from milestream.infra.secret_env import stage_environment
from milestream.infra.services import die_with_parent
from milestream.streams.processor import BATCH

WITHIN_S = 0.05  # the processor's consume timeout


class ForwardApp(faust.App):
    """faust.App whose aiokafka consumer waits ``fetch_wait_ms`` at most for a fetch (as main's processor did)."""

    fetch_wait_ms: int = 50

    def _new_consumer(self):
        consumer = super()._new_consumer()
        create = consumer._thread._create_worker_consumer

        def create_with_short_wait(transport):
            client = create(transport)
            client._fetch_max_wait_ms = self.fetch_wait_ms
            return client

        consumer._thread._create_worker_consumer = create_with_short_wait
        return consumer


def forward_app(cfg: Config, output: str, sources: list[str], datadir: Path) -> ForwardApp:
    app = ForwardApp(
        f"{cfg.broker.topic_prefix}faust-forward", broker=f"kafka://{cfg.broker.bootstrap_servers}",
        datadir=str(datadir), value_serializer="raw", key_serializer="raw",
        web_enabled=False, topic_allow_declare=False, topic_disable_leader=True,
        broker_session_timeout=6, broker_heartbeat_interval=1, consumer_auto_offset_reset="earliest",
        producer_linger=0.005, producer_max_batch_size=1_000_000,
        producer_max_request_size=cfg.broker.max_message_bytes, consumer_max_fetch_size=cfg.broker.max_message_bytes,
    )
    app.fetch_wait_ms = cfg.broker.fetch_wait_ms
    out = app.topic(output)

    @app.agent(app.topic(*sources), name="forward")
    async def forward(stream) -> None:
        async for events in stream.take_events(BATCH, within=WITHIN_S):
            for event in events:
                await out.send(key=event.key, value=event.value, headers=event.message.headers)

    return app


def start(cfg: Config, output: str, sources: list[str], workdir: Path) -> subprocess.Popen:
    """The app in its own process (SIGTERM stops it); its log goes to ``workdir``/faust-forward.log."""
    config_path = workdir / f"{cfg.broker.topic_prefix}faust-forward.yaml"
    config_path.write_text(cfg.to_yaml())
    with open(workdir / "faust-forward.log", "ab") as log:
        return subprocess.Popen([sys.executable, __file__, str(config_path), output, *sources],
                                env=stage_environment(cfg), stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("output", metavar="OUTPUT_TOPIC", help="a full topic name")
    parser.add_argument("sources", metavar="SOURCE_TOPIC", nargs="+", help="full topic names")
    args = parser.parse_args()
    datadir = args.config.with_suffix(".data")  # next to the config, in the caller's scratch folder
    app = forward_app(load_config(args.config), args.output, args.sources, datadir)
    faust.Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
