"""The user's data (producers/data.py): JSONL, Parquet and datasets folders onto ``prompts`` with their
column mapping, chat prompts, weighted sources, shuffling and epochs; held-out files; bad input named."""
from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from milestream.cli import main
from milestream.config import Config, load_config
from milestream.infra.kafka import RecordConsumer
from milestream.producers.data import DataError, held_out, prompt_messages, prompt_stream, reward_inputs
from milestream.producers.inputs import check_inputs
from milestream.producers.loader import load_prompts
from milestream.producers.tasks import chat_input_ids
from milestream.schemas import topics

ROWS = [{"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": i + 2, "level": i % 3, "id": i}
        for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_datasets_folder(path: Path, rows: list[dict]) -> Path:
    """The layout of ``Dataset.save_to_disk``: Arrow IPC stream files listed in state.json."""
    path.mkdir()
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (path / "dataset_info.json").write_text("{}")
    return path


MAPPING = {"prompt_key": "question", "label_key": "answer", "metadata_keys": ["level", "id"]}


def read_prompts(cfg, group: str = "audit") -> list:
    consumer = RecordConsumer(cfg.broker, topics.PROMPTS, group).assign(partitions=range(cfg.broker.partitions))
    records = [r for d in consumer.drain(idle_s=1.0) for r in d.records]
    consumer.close()
    return records


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet, write_datasets_folder])
def test_each_file_kind_feeds_prompts_with_its_columns_mapped(cfg, tmp_path, writer):
    path = writer(tmp_path / {"write_jsonl": "qa.jsonl", "write_parquet": "qa.parquet"}.get(writer.__name__, "qa"),
                  ROWS)
    cfg = cfg.with_overrides(data={"path": str(path), **MAPPING})
    check_inputs(cfg)
    assert load_prompts(cfg, count=10) == 10
    prompts = sorted(read_prompts(cfg), key=lambda p: p.index)
    assert [p.index for p in prompts] == list(range(10))
    first = prompts[0]
    assert first.prompt_id.startswith("qa-s42-e0-") and first.dataset == "qa"
    assert (first.question, first.answer) == (ROWS[0]["question"], "2")
    assert reward_inputs(cfg, first) == ("2", {"level": 0, "id": 0})
    assert prompt_messages(cfg, first) == [{"role": "user", "content": ROWS[0]["question"]}]  # no system prompt


def test_a_saved_datasets_folder_reads_as_written_by_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    cfg = Config().with_overrides(data={"path": str(tmp_path / "saved"), **MAPPING, "shuffle": False})
    assert [p.answer for p in islice(prompt_stream(cfg), 3)] == ["2", "3", "4"]


def test_chat_message_prompts_travel_and_reach_the_template(tmp_path, tokenizer):
    chats = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
              "label": "4"},
             {"messages": [{"role": "user", "content": "3 + 3?"}], "label": "6"}]
    path = write_jsonl(tmp_path / "chat.jsonl", chats)
    cfg = Config().with_overrides(data={"path": str(path), "prompt_key": "messages", "shuffle": False,
                                        "system_prompt": "Answer with a number."})
    own_system, plain = islice(prompt_stream(cfg), 2)
    assert own_system.question == "2 + 2?" and json.loads(own_system.entry_json)["messages"] == chats[0]["messages"]
    assert prompt_messages(cfg, own_system) == chats[0]["messages"]  # its own system message is kept
    assert prompt_messages(cfg, plain)[0] == {"role": "system", "content": "Answer with a number."}
    text = tokenizer.decode(chat_input_ids(tokenizer, prompt_messages(cfg, own_system), ""))
    assert "Be brief." in text and "2 + 2?" in text and text.rstrip().endswith("assistant")


def test_two_weighted_sources_interleave_deterministically(tmp_path):
    write_jsonl(tmp_path / "easy.jsonl", [{"prompt": f"e{i}", "label": i} for i in range(30)])
    write_parquet(tmp_path / "hard.parquet", [{"prompt": f"h{i}", "label": i} for i in range(30)])
    cfg = Config().with_overrides(data={"sources": [{"path": str(tmp_path / "easy.jsonl"), "weight": 3},
                                                    {"path": str(tmp_path / "hard.parquet"), "weight": 1}]})
    first = list(islice(prompt_stream(cfg), 40))
    assert [p.dataset for p in first].count("easy") == 30 and [p.dataset for p in first].count("hard") == 10
    assert [p.dataset for p in first[:8]] == ["easy", "easy", "hard", "easy"] * 2  # smooth: no long runs
    assert [p.prompt_id for p in first] == [p.prompt_id for p in islice(prompt_stream(cfg), 40)]
    assert [p.prompt_id for p in islice(prompt_stream(cfg, 25), 15)] == [p.prompt_id for p in first[25:40]]


def test_shuffling_follows_the_seed_and_epochs_end_the_stream(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"q{i}", "label": i} for i in range(20)])
    cfg = Config().with_overrides(data={"path": str(path), "epochs": 2})
    stream = list(prompt_stream(cfg))
    assert len(stream) == 40  # two epochs, then the end
    epoch0, epoch1 = [p.index for p in stream[:20]], [p.index for p in stream[20:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != list(range(20)) and epoch0 != epoch1  # shuffled, each epoch its own order
    assert [p.prompt_id for p in stream] == [p.prompt_id for p in prompt_stream(cfg)]  # same seed, same order
    other = [p.index for p in islice(prompt_stream(cfg.with_overrides(data={"seed": 7})), 20)]
    assert other != epoch0 and sorted(other) == list(range(20))
    unshuffled = cfg.with_overrides(data={"shuffle": False})
    assert [p.index for p in islice(prompt_stream(unshuffled), 20)] == list(range(20))


def test_a_held_out_file_is_the_evaluation_set(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:6])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[6:])
    cfg = Config().with_overrides(data={"path": str(train), **MAPPING},
                                  eval={"mode": "dedicated", "path": str(test), "num_prompts": 3})
    prompts = held_out(cfg)
    assert [(p.question, p.answer) for p in prompts] == [(r["question"], str(r["answer"])) for r in ROWS[6:9]]
    assert not {p.question for p in prompts} & {p.question for p in islice(prompt_stream(cfg), 12)}


# ---- bad input is named before anything starts -----------------------------------------------------------

def bad_input(tmp_path: Path, content: str, **knobs) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    cfg = Config().with_overrides(data={"path": str(path)}, **knobs)
    with pytest.raises(DataError) as error:
        check_inputs(cfg)
    return str(error.value).replace(str(path), "FILE")


def test_bad_input_names_file_line_column_and_import_path(tmp_path):
    good = json.dumps({"prompt": "2 + 2?", "label": "4"}) + "\n"
    assert bad_input(tmp_path, good + '{"prompt": "3 + 3?", "label": \n') == \
        "FILE line 2: not JSON (Expecting value at column 31)"
    assert bad_input(tmp_path, good + json.dumps({"question": "x", "label": "1"}) + "\n") == \
        "FILE line 2: no column 'prompt' (columns: ['label', 'question'])"
    assert bad_input(tmp_path, "\n\n") == "data file FILE has no rows"
    assert bad_input(tmp_path, good + "[1, 2]\n") == "FILE line 2: a list, not a JSON object"
    assert bad_input(tmp_path, json.dumps({"prompt": 7, "label": "4"})) == \
        "FILE line 1: column 'prompt' is neither text nor a list of chat messages {role, content}"
    assert bad_input(tmp_path, good, reward={"fn": "no_such_module:score"}).startswith(
        "reward.fn 'no_such_module:score' does not name a function")
    long_prompt = json.dumps({"prompt": "many words " * 200, "label": "1"}) + "\n"
    assert bad_input(tmp_path, good + long_prompt, rollout={"max_context_tokens": 256}).startswith(
        "FILE line 2: the prompt takes ")
    with pytest.raises(DataError, match="data file .*missing.jsonl does not exist"):
        check_inputs(Config().with_overrides(data={"path": str(tmp_path / "missing.jsonl")}))


def test_a_parquet_file_without_the_column_is_named(tmp_path):
    path = write_parquet(tmp_path / "qa.parquet", ROWS)
    with pytest.raises(DataError, match=r"qa.parquet row 0: no column 'prompt' \(columns: \['answer', 'id'"):
        check_inputs(Config().with_overrides(data={"path": str(path)}))


def test_the_recipe_example_is_valid_and_scores_with_its_reward(monkeypatch):
    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)  # the recipe's paths and its reward's import path are relative to the repository
    cfg = load_config(root / "examples/recipe/config.yaml")
    check_inputs(cfg)
    assert len(list(islice(prompt_stream(cfg), 100))) == 100 and len(held_out(cfg)) == 20
    train = {p.question for p in islice(prompt_stream(cfg), 60)}
    assert len(train) == 60 and not train & {p.question for p in held_out(cfg)}


@pytest.mark.parametrize("command", ["run", "load-prompts"])
def test_run_and_load_prompts_refuse_bad_input_before_starting_anything(tmp_path, command, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2 + 2?", "label": "4"}])
    assert main([command, "--set", f"data.path={data}", "--run-dir", str(tmp_path / "run")]) == 2  # a user error
    assert f"milestream {command}: {data} line 1: no column 'prompt'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no run folder: nothing (broker, stages) was started


def test_a_reasoning_gym_task_is_one_source_kind_among_files(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": f"q{i}", "label": i} for i in range(5)])
    cfg = Config().with_overrides(data={"sources": [{"task": "chain_sum", "size": 10}, {"path": str(path)}]})
    assert cfg.data.system_prompt == ""  # a source with a path: a user data set
    first = list(islice(prompt_stream(cfg), 6))
    assert [p.prompt_id.split("-e")[0] for p in first] == ["chain_sum-s42", "qa-s42"] * 3
    task, row = first[0], first[1]
    assert task.prompt_id == "chain_sum-s42-e0-0" and reward_inputs(cfg, task) == (task.answer, json.loads(task.entry_json))
    assert reward_inputs(cfg, row) == (row.answer, {})
    only_tasks = Config().with_overrides(data={"sources": [{"task": "chain_sum"}, {"task": "basic_arithmetic"}]})
    assert only_tasks.data.system_prompt == Config().data.system_prompt  # still the demo's prompt
