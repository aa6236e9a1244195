"""Rewards (producers/rewards.py): the built-in verifiers, a user's function and group function, and a
reward service over HTTP (a small aiohttp server on 127.0.0.1) with its timeout, retries and limit."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from milestream.config import Config
from milestream.producers.rewards import Reward, RewardSample, as_reward, load_reward
from milestream.producers.rollout import RewardFigures

PLUGINS = str(Path(__file__).parents[1] / "plugins")
CHAIN_SUM_ENTRY = {"question": "What is 4 + 3?", "answer": "7", "metadata": {}}


def sample(response: str, label: str | None = "7", source: str = "chain_sum", **fields) -> RewardSample:
    return RewardSample(source=source, prompt="q", messages=({"role": "user", "content": "q"},), response=response,
                        label=label, metadata=fields.pop("metadata", {}), **fields)


def score(cfg: Config, *samples: RewardSample) -> list[Reward]:
    return asyncio.run(load_reward(cfg)(list(samples)))


@pytest.mark.parametrize(("response", "label", "value"), [
    ("The answer is 1,234.", "1234", 1.0),  # commas
    ("so it is 7.0", "7", 1.0),  # trailing .0
    ("first 3, then \\boxed{12}", "12", 1.0),  # boxed wins over the last number
    ("\\boxed{12} or 13", "13", 0.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),  # latex fraction
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
    ("it is 3/4", "0.75", 1.0),  # plain fraction
    ("50%", "0.5", 1.0),  # percent
    ("a rise of 50\\%", "50%", 1.0),
    ("$1,000", "1000", 1.0),
    ("-5", "-5", 1.0),
    ("\\boxed{x + 1}", "x + 1", 1.0),  # not a number: compared as text
    ("no number at all", "7", 0.0),
    ("7", None, 0.0),  # no label: nothing to match
])
def test_math_verifier(response: str, label: str | None, value: float) -> None:
    cfg = Config().with_overrides(reward={"verifier": "math"})
    assert score(cfg, sample(response, label))[0].value == value


@pytest.mark.parametrize(("verifier", "pattern", "response", "label", "value"), [
    ("exact_match", None, " Paris\n", "Paris", 1.0),
    ("exact_match", None, "paris", "Paris", 0.0),
    ("exact_match", None, "Paris", None, 0.0),
    ("regex", r"answer: (\w+)", "so the answer: Paris.", "Paris", 1.0),
    ("regex", r"answer: (\w+)", "so the answer: Rome.", "Paris", 0.0),
    ("regex", r"\bParis\b", "It is Paris.", None, 1.0),  # no group: the match alone counts
    ("regex", r"\bParis\b", "It is Parisian.", None, 0.0),
])
def test_text_verifiers(verifier: str, pattern: str | None, response: str, label: str | None, value: float) -> None:
    cfg = Config().with_overrides(reward={"verifier": verifier, "pattern": pattern})
    assert score(cfg, sample(response, label))[0].value == value


@pytest.mark.parametrize(("response", "value"), [
    ("7</answer>", 1.1), ("9</answer>", 0.1), ("7", 0.0), ("4 + 3 = 7</answer>", 1.1), ("</answer>", 0.1),
])
def test_answer_tag_is_the_demos_default_with_todays_figures(response: str, value: float) -> None:
    (reward,) = score(Config(), sample(response, metadata=CHAIN_SUM_ENTRY))
    assert reward.value == pytest.approx(value) and reward.components == {} and not reward.error


def test_answer_tag_on_a_user_data_set_matches_the_label(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "4 + 3?", "label": "7"}) + "\n")
    cfg = Config().with_overrides(data={"path": str(data), "assistant_prefill": "<answer>"},
                                  reward={"verifier": "answer_tag"})
    rewards = score(cfg, sample("7.0</answer>", source="qa"), sample("8</answer>", source="qa"))
    assert [r.value for r in rewards] == [pytest.approx(1.1), pytest.approx(0.1)]


def test_a_user_data_set_defaults_to_math_against_the_label(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "4 + 3?", "label": "7"}) + "\n")
    cfg = Config().with_overrides(data={"path": str(data)})
    assert (cfg.data.system_prompt, cfg.data.assistant_prefill) == ("", "")  # no demo prompt for user data
    assert [r.value for r in score(cfg, sample("It is 7", source="qa"))] == [1.0]


def test_custom_reward_functions_sync_async_float_and_dict(monkeypatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    plain = Config().with_overrides(reward={"fn": "reward_hooks:length_penalty"})
    assert [r.value for r in score(plain, sample("7"), sample("12345"))] == [1.0, pytest.approx(-0.05)]
    graded = Config().with_overrides(reward={"fn": "reward_hooks:graded"})
    right, wrong = score(graded, sample("7"), sample("wrong answer"))
    assert right == Reward(2.0, {"correct": 1.0, "short": 1.0})  # no reward.key: the sum trains
    assert wrong == Reward(0.0, {"correct": 0.0, "short": 0.0})
    keyed = graded.with_overrides(reward={"key": "correct"})
    assert score(keyed, sample("7"))[0] == Reward(1.0, {"correct": 1.0, "short": 1.0})


def test_a_reward_that_fails_or_times_out_is_an_error_not_a_zero(monkeypatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    (raised,) = score(Config().with_overrides(reward={"fn": "reward_hooks:fails_on_odd_rows"}),
                      sample("7", metadata={"row": 3}))
    assert raised.error == "RuntimeError: no reward for row 3"
    (slow,) = score(Config().with_overrides(reward={"fn": "reward_hooks:slow", "timeout_s": 0.2}), sample("7"))
    assert slow.error == "timed out after 0.2s"
    (bad,) = score(Config().with_overrides(reward={"fn": "reward_hooks:not_a_number"}), sample("7"))
    assert bad.error == "TypeError: reward is 'high', not a finite number"
    missing_key = Config().with_overrides(reward={"fn": "reward_hooks:graded", "key": "style"})
    assert "reward.key 'style' is not among the components" in score(missing_key, sample("7"))[0].error


def test_a_group_reward_scores_the_whole_group(monkeypatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    reward = load_reward(Config().with_overrides(reward={"group_fn": "reward_hooks:pairwise"}))
    assert reward.per_group
    rewards = asyncio.run(reward([sample("1"), sample("three"), sample("22")]))
    assert [r.value for r in rewards] == [0.0, 1.0, 0.0]
    graded = load_reward(Config().with_overrides(reward={"group_fn": "reward_hooks:pairwise_graded", "key": "longest"}))
    assert asyncio.run(graded([sample("1"), sample("22")])) == [Reward(0.0, {"longest": 0.0, "bonus": 0.5}),
                                                                Reward(1.0, {"longest": 1.0, "bonus": 0.5})]


def test_an_import_path_that_does_not_resolve_is_named() -> None:
    with pytest.raises(ValueError, match="reward.fn 'reward_hooks_missing:score' does not name a function"):
        load_reward(Config().with_overrides(reward={"fn": "reward_hooks_missing:score"}))


def test_dict_rewards_are_checked() -> None:
    assert as_reward({"a": 1, "b": 0.5}, None) == Reward(1.5, {"a": 1.0, "b": 0.5})
    with pytest.raises(TypeError, match="component 'b' is nan"):
        as_reward({"a": 1, "b": float("nan")}, None)


# ---- a reward service ---------------------------------------------------------------------------------

class RewardServer:
    """A reward model stand-in: /score answers, /flaky fails twice with a 500 first, /down always does,
    /slow answers too late; it counts calls and the most requests in flight at once."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.inflight = self.max_inflight = 0
        self.received: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.calls[name] = self.calls.get(name, 0) + 1
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            body = await request.json()
            self.received.append(body)
            await asyncio.sleep(1.0 if name == "slow" else 0.05)
            if name == "down" or (name == "flaky" and self.calls[name] <= 2):
                return web.Response(status=500, text="model not loaded")
            rewards = [{"quality": len(s["response"]) / 10, "label_seen": float(s["label"] == "7")}
                       for s in body["samples"]]
            return web.json_response({"rewards": rewards})
        finally:
            self.inflight -= 1


async def with_server(test) -> None:
    server = RewardServer()
    app = web.Application()
    app.router.add_post("/{name}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        await test(server, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def service(url: str, **knobs) -> object:
    return load_reward(Config().with_overrides(reward={"url": url, "timeout_s": 0.5, "retries": 2, **knobs}))


def test_reward_service_answers_with_dicts_and_gets_the_samples_as_json() -> None:
    async def test(server: RewardServer, base: str) -> None:
        rewards = await service(f"{base}/score", key="quality")([sample("12345"), sample("7", label="8")])
        assert rewards == [Reward(0.5, {"quality": 0.5, "label_seen": 1.0}),
                           Reward(0.1, {"quality": 0.1, "label_seen": 0.0})]
        (body,) = server.received
        assert body["samples"][0]["response"] == "12345" and body["samples"][0]["messages"][0]["role"] == "user"
    asyncio.run(with_server(test))


def test_reward_service_retries_a_500_and_gives_up_with_an_error() -> None:
    async def test(server: RewardServer, base: str) -> None:
        (flaky,) = await service(f"{base}/flaky")([sample("7")])
        assert flaky.value == pytest.approx(1.1) and server.calls["flaky"] == 3  # two 500s, then an answer
        down = await service(f"{base}/down", retries=1)([sample("7"), sample("8")])
        assert server.calls["down"] == 2
        assert [r.error for r in down] == [f"RuntimeError: reward.url {base}/down: 2 tries failed, the last with "
                                           "HTTP 500: model not loaded"] * 2
    asyncio.run(with_server(test))


def test_reward_service_times_out() -> None:
    async def test(server: RewardServer, base: str) -> None:
        (slow,) = await service(f"{base}/slow", timeout_s=0.2, retries=1)([sample("7")])
        assert server.calls["slow"] == 2 and "2 tries failed" in slow.error and "timed out" in slow.error
    asyncio.run(with_server(test))


def test_reward_service_keeps_to_its_concurrency_limit() -> None:
    async def test(server: RewardServer, base: str) -> None:
        reward = service(f"{base}/score", max_concurrency=2)
        groups = await asyncio.gather(*(reward([sample(str(i))]) for i in range(8)))
        assert len(groups) == 8 and all(not g[0].error for g in groups)
        assert server.calls["score"] == 8 and server.max_inflight == 2
    asyncio.run(with_server(test))


def test_every_component_becomes_a_worker_metric() -> None:
    figures = RewardFigures()
    for reward in (Reward(2.0, {"correct": 1.0, "short": 1.0}), Reward(0.0, {"correct": 0.0, "short": 0.0}),
                   Reward(0.0, error="RuntimeError: boom")):
        figures.add(reward)
    assert figures.take() == {"reward/correct": 0.5, "reward/short": 0.5, "reward_errors": 1.0}
    assert figures.take() == {"reward_errors": 0.0}  # each report covers the samples since the last one
