"""The one way milestream opens a Redis connection: ``redis.url`` with ``redis.password`` and the TLS files.

The URL never carries the password (config.RedisConfig moves it out), so it can be logged as it is. It
is the package's only importer of redis (tests/test_layout.py): no client is built without these settings.
"""
from __future__ import annotations

import redis
from redis import RedisError

__all__ = ["RedisError", "redis_client"]

from milestream.config import RedisConfig

TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def redis_client(cfg: RedisConfig, **options: object) -> redis.Redis:
    """A client of ``cfg.url`` authenticated with ``cfg.password``; a rediss:// URL gets the TLS files."""
    if not cfg.url:
        raise ValueError("redis.url is not set (start the embedded Redis first)")
    password = cfg.password.get_secret_value() if cfg.password else None
    tls = {name: path for name in TLS_FILES if (path := getattr(cfg, name))}
    return redis.Redis.from_url(cfg.url, password=password, **tls, **options)
