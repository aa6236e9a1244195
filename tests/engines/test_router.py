"""Three CPU engine processes (tiny random model) behind the affinity router, over SGLang's HTTP API.

Load is made visible without timing: the engines are paused (through the router, which broadcasts
it), so every request sent stays in flight until they continue; each next request is sent only once
the router counts the previous one as in flight.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch

from milestream.config import Config, ModelConfig, RouterConfig
from milestream.infra.model import load_model, trainable_state_dict
from milestream.engines.engine import GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.http_api import ROUTING_KEY_HEADER
from milestream.engines.http_engine import EngineHttpError, HttpEngine, RouterClient, router_backend
from milestream.engines.router import AffinityTable, sglang_router_args
from milestream.streams.weights.base import engine_weights_dir
from milestream_testkit.servers import CONTROL_TOKEN, MODEL, get_json, post_json, ready_urls, start, stop

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0)


@dataclass(frozen=True)
class Cluster:
    engines: list[str]  # engine i is "e-i"
    router: str
    run_dir: Path  # the engines load weight versions from its weight folders only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("router")
    engines = start(["engine", "--engines", "3", "--port", "0", "--engine-id", "e", "--run-dir", str(logs), *MODEL],
                    logs / "engines.log")
    try:
        by_name = ready_urls(engines, 3, logs / "engines.log")
        urls = [by_name[f"engine e-{i}"] for i in range(3)]
        router = start(["router", "--set", f"router.engines=[{', '.join(urls)}]", "--set", "router.port=0"],
                       logs / "router.log")
        try:
            yield Cluster(urls, ready_urls(router, 1, logs / "router.log")["router"], logs)
        finally:
            stop(router)
    finally:
        stop(engines)


async def _turn(http: aiohttp.ClientSession, router: str, key: str, input_ids: list[int]) -> tuple[str, list[int]]:
    """One turn of session ``key``: (the engine that served it, the tokens it generated)."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    status, reply = await post_json(http, router + "/generate", body, key)
    assert status == 200, reply
    return reply["meta_info"]["engine_id"], reply["output_ids"]


async def _wait_in_flight(http: aiohttp.ClientSession, router: str, count: int) -> None:
    while True:
        engines = (await get_json(http, router + "/get_server_info"))["engines"]
        if sum(upstream["active_requests"] for ranks in engines for upstream in ranks) >= count:
            return
        await asyncio.sleep(0.02)


async def _served(http: aiohttp.ClientSession, cluster: Cluster) -> list[int]:
    return [(await get_json(http, url + "/get_server_info"))["internal_states"][0]["requests_served"]
            for url in cluster.engines]


def test_a_session_stays_on_one_engine_and_new_sessions_go_to_the_least_loaded(cluster: Cluster) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            assert (await post_json(http, cluster.router + "/pause_generation", {}))[0] == 200  # to all three
            # session a opens with three requests at once, then five new sessions arrive one by one
            keys = ["a", "a", "a", "b", "c", "d", "e", "f"]
            held = []
            for sent, key in enumerate(keys, start=1):
                held.append(asyncio.create_task(_turn(http, cluster.router, key, [1, 2, 3 + sent])))
                await _wait_in_flight(http, cluster.router, sent)
            assert (await post_json(http, cluster.router + "/continue_generation", {}))[0] == 200
            first = await asyncio.gather(*held)
            engine_of = {key: engine for key, (engine, _) in zip(keys, first)}
            assert {engine for key, (engine, _) in zip(keys, first) if key == "a"} == {engine_of["a"]}
            # a's engine held 3 requests: no new session went there; the others took turns by load
            # (b, c to the idle ones; d, e, f each to the one with fewer requests, ties to fewer sessions)
            assert engine_of == {"a": "e-0", "b": "e-1", "c": "e-2", "d": "e-1", "e": "e-2", "f": "e-1"}

            # later turns extend each session's tokens and still reach its engine
            history = {key: [1, 2, 3 + i] + out for i, (key, (_, out)) in enumerate(zip(keys, first))}
            for _ in range(2):
                for key in "abcdef":
                    engine, output = await _turn(http, cluster.router, key, history[key] + [7])
                    assert engine == engine_of[key]
                    history[key] += [7, *output]

            # the session service's backend (sessions.backend=...:router_backend): generate(ids, sampling, key)
            port = int(cluster.router.rsplit(":", 1)[1])
            client = router_backend(Config().with_overrides(router={"port": port, "engines": [cluster.engines]},
                                                            run={"control_token": CONTROL_TOKEN}))
            before = await _served(http, cluster)
            result = await client.generate(history["d"], SAMPLING, "d")
            after = await _served(http, cluster)
            assert [b - a for a, b in zip(before, after)] == [0, 1, 0]  # d lives on e-1
            assert isinstance(result, GenerateResult) and len(result.output_ids) == len(result.logprobs) == 4
            assert await client.end_session("d") and not await client.end_session("d")
            await client.close()

    asyncio.run(scenario())


def test_a_request_without_a_routing_key_is_refused_and_reaches_no_engine(cluster: Cluster) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            before = await _served(http, cluster)
            for key in (None, "  "):
                status, reply = await post_json(http, cluster.router + "/generate", {"input_ids": [1, 2]}, key)
                assert status == 400 and reply["message"].startswith(f"{ROUTING_KEY_HEADER}: missing header")
            status, reply = await post_json(http, cluster.router + "/generate", {"input_ids": [1, "x"]}, "z")
            assert status == 400 and reply["message"] == "input_ids[1]: expected an integer, got 'x'"
            assert await _served(http, cluster) == before
        with pytest.raises(ValueError, match="routing_key"):
            await RouterClient(cluster.router).generate([1, 2], SAMPLING, "")

    asyncio.run(scenario())


def test_http_engine_updates_every_engine_behind_the_router(cluster: Cluster) -> None:
    """The rollout worker's Engine protocol over HTTP: pause, a new version from disk on all three
    engines, resume; the tokens carry the new version."""
    model = load_model(ModelConfig(name="tiny-random", dtype="float32", lora_rank=0), dtype=torch.float32)
    tensors = {name: tensor + 0.01 for name, tensor in trainable_state_dict(model).items()}

    async def scenario() -> None:
        staged = engine_weights_dir(cluster.run_dir) / "staged"
        engine = HttpEngine(cluster.router, weights_dir=staged, token=CONTROL_TOKEN)
        try:
            await engine.pause()
            await engine.update_weights(1, tensors)
            await engine.resume()
            async with aiohttp.ClientSession() as http:
                versions = [(await get_json(http, url + "/get_weight_version"))["weight_version"]
                            for url in cluster.engines]
            assert versions == ["1", "1", "1"]
            results = [await engine.generate_keyed(_request(f"g{i}/0"), f"g{i}") for i in range(3)]
            assert all(r.versions == (1,) * 4 for r in results)
            with pytest.raises(EngineHttpError, match="failed on 3 of 3 upstreams.*v000002.safetensors: No such file"):
                await engine.update_weights_from_disk(staged / "v000002.safetensors", 2)
        finally:
            await engine.close()

    asyncio.run(scenario())


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, (5, 6, 7), SAMPLING)


def test_affinity_table_is_bounded_releases_keys_and_picks_the_idle_rank() -> None:
    table = AffinityTable([["http://a0", "http://a1"], ["http://b0"]], max_sessions=2)
    first = table.route("s1")
    table.active[first] += 1
    second = table.route("s2")
    assert (first.engine, first.rank, second.engine) == (0, 0, 1)
    table.active[second] += 5
    third = table.route("s3")  # engine 0 is less loaded; within it rank 1 is idle
    assert (third.engine, third.rank) == (0, 1)
    assert list(table.sessions) == ["s2", "s3"] and table.evicted == 1  # s1, least recently used, forgotten
    assert table.route("s2") == second and list(table.sessions) == ["s3", "s2"]
    assert table.release("s3") and not table.release("s3") and table.bound[third] == 0
    with pytest.raises(ValueError, match="router.engines"):
        AffinityTable([], max_sessions=1)


def test_sglang_router_gets_the_same_engines_policy_and_header() -> None:
    cfg = RouterConfig(engines=(("http://a0", "http://a1"), ("http://b0",)), port=30100)
    args = sglang_router_args(cfg)
    assert args[args.index("--worker-urls") + 1:args.index("--policy")] == ["http://a0", "http://a1", "http://b0"]
    assert args[args.index("--policy"):args.index("--policy") + 4] == ["--policy", "manual", "--assignment-mode",
                                                                        "min_load"]
    with pytest.raises(ValueError, match="reads X-SMG-Routing-Key only"):
        sglang_router_args(cfg.model_copy(update={"key_header": "X-Session"}))


def test_rollout_worker_generates_through_the_router(cluster: Cluster, cfg) -> None:
    """``rollout.engine_url``: the rollout worker's samples come from the engine servers behind the
    router, a group's samples on one engine (its routing key is the group id)."""
    from milestream.infra.kafka import RecordConsumer
    from milestream.infra.model import load_tokenizer
    from milestream.producers.loader import load_prompts
    from milestream.producers.worker import RolloutWorker, make_engine
    from milestream.schemas import topics
    from stage_runs import published_groups, run_until

    cfg = cfg.with_overrides(rollout={"engine_url": cluster.router, "group_size": 2})
    load_prompts(cfg, count=4)
    engine = make_engine(cfg, "w-http")
    assert isinstance(engine, HttpEngine)
    worker = RolloutWorker(cfg, "w-http", engine, load_tokenizer(cfg.model))
    worker.weights_ready.set()  # the engines hold their own weights; no version is published here
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    seen: dict[str, list] = {}
    asyncio.run(run_until(worker, lambda: len(published_groups(trajectories, seen)) >= 2))
    asyncio.run(engine.close())
    trajectories.close()
    groups = [g for g in seen.values() if len(g) == 2]
    assert len(groups) >= 2
    for group in groups:
        for trajectory in group:
            assert 0 < len(trajectory.response_ids) == len(trajectory.token_versions) <= cfg.rollout.max_new_tokens
            assert trajectory.status in ("completed", "truncated")
