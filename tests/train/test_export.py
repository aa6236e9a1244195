"""A model folder (model.path) trained a step on the local backend, LoRA and full fine-tuning, then taken
away with ``milestream export``: the folder reloads in plain transformers with the trainer's logits and
the checksums of the version's weights.versions record."""
from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from model_folders import tiny_llama_folder
from test_routing_replay import samples_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from milestream.cli import main
from milestream.config import Config
from milestream.engines.engine import CpuEngine, GenerateRequest, SamplingParams
from milestream.streams.weights.base import weights_dir
from milestream.streams.weights.disk import prune, write_full
from milestream.train import checkpoint
from milestream.train.export import FACTS_FILE, VersionNotKept, export_version
from milestream.train.learner import CollectedGroup, Learner

PROMPT = (1, 17, 230, 4051, 9, 77, 12)
PROBE = torch.tensor([[1, 17, 230, 4051, 9, 77, 12, 500, 3, 44]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("models") / "tiny-llama")


def run_config(folder: Path, run_dir: Path, lora_rank: int) -> Config:
    return Config().with_overrides(
        model={"path": str(folder), "lora_rank": lora_rank, "dtype": "float32", "seed": 3},
        trainer={"lr": 1e-2, "keep_weight_versions": 2}, run={"run_dir": str(run_dir)})


def trained_step(cfg: Config) -> Learner:
    """One step on a group the engine generated from the folder's model."""
    engine = CpuEngine(cfg.model, cfg.rollout, seed=5)

    async def group():
        sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
        try:
            return await asyncio.gather(*(engine.generate(GenerateRequest(f"r{i}", PROMPT, sampling)) for i in range(4)))
        finally:
            await engine.close()

    learner = Learner(cfg)
    before = {n: t.clone() for n, t in learner.export_weights().items()}
    figures = learner.train_step([CollectedGroup("g", samples_of(asyncio.run(group()), PROMPT), staleness=0)])
    assert figures["grad_norm"] > 0
    assert any(not torch.equal(before[n], t) for n, t in learner.export_weights().items())
    return learner


def trainer_logits(learner: Learner) -> torch.Tensor:
    with torch.no_grad():
        return learner.backend.model(PROBE).logits


def exported_logits(out: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.float32
    with torch.no_grad():
        return model(PROBE).logits


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_trained_version_exports_to_a_folder_plain_transformers_loads(folder: Path, tmp_path: Path,
                                                                       lora_rank: int) -> None:
    cfg = run_config(folder, tmp_path / "run", lora_rank)
    learner = trained_step(cfg)
    _, names, sums = write_full(weights_dir(cfg.run.run_dir), 1, 1, learner.export_weights())  # as DiskSender does
    exported = export_version(cfg, tmp_path / "out")
    assert (exported.version, exported.step, exported.merged) == (1, 1, lora_rank > 0)
    facts = json.loads((tmp_path / "out" / FACTS_FILE).read_text())
    assert facts["checksums"] == dict(zip(names, sums)) and facts["base"] == str(folder)
    got, want = exported_logits(tmp_path / "out"), trainer_logits(learner)
    if lora_rank:  # merged into the base weights: W + BA rounds otherwise than x W + (x A) B
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:
        assert torch.equal(got, want)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(folder).chat_template


def test_the_adapter_alone_loads_on_the_base_folder(folder: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    cfg = run_config(folder, tmp_path / "run", lora_rank=4)
    learner = trained_step(cfg)
    write_full(weights_dir(cfg.run.run_dir), 1, 1, learner.export_weights())
    export_version(cfg, tmp_path / "adapter", adapter=True)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(model(PROBE).logits, trainer_logits(learner))
    with pytest.raises(ValueError, match="--adapter: this run fine-tuned every weight"):
        export_version(run_config(folder, tmp_path / "run", lora_rank=0), tmp_path / "again", adapter=True)


def test_the_cli_exports_a_checkpointed_version_and_names_what_is_no_longer_kept(
        folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    cfg = run_config(folder, run_dir, lora_rank=0)
    learner = trained_step(cfg)
    checkpoint.save(run_dir, checkpoint.TrainerState(step=2, version=2), learner.state_dict())
    for version in (3, 4, 5):
        write_full(weights_dir(run_dir), version, version, learner.export_weights())
    prune(weights_dir(run_dir), keep_from=4)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())

    assert main(["export", "--run-dir", str(run_dir), "--version", "2", "--out", str(tmp_path / "v2")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["version"] == 2 and printed["source"].endswith("step_000002")
    assert torch.equal(exported_logits(tmp_path / "v2"), trainer_logits(learner))
    assert main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "newest")]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 5  # the newest kept
    with pytest.raises(VersionNotKept, match=r"version 3 of .* is no longer kept: it holds versions \[2, 4, 5\]"):
        export_version(cfg, tmp_path / "v3", version=3)
    with pytest.raises(FileExistsError, match="not empty"):
        export_version(cfg, tmp_path / "v2", version=2)


def test_every_exported_file_has_the_mode_the_umask_gives(folder: Path, tmp_path: Path) -> None:
    cfg = run_config(folder, tmp_path / "run", lora_rank=0)
    write_full(weights_dir(cfg.run.run_dir), 1, 1, Learner(cfg).export_weights())
    before = os.umask(0o027)
    try:
        export_version(cfg, tmp_path / "out")
    finally:
        os.umask(before)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o640)}, modes


class RecordingProducer:
    """Stands in for the broker: keeps what a sender announces on weights.versions."""

    def __init__(self) -> None:
        self.records: list = []

    def send(self, topic: str, records: list, key: str | None = None) -> None:
        self.records += records

    def flush(self) -> None:
        pass


def test_a_version_of_a_delta_chain_exports_with_its_records_checksums(folder: Path, tmp_path: Path) -> None:
    from milestream.infra.model import load_model, trainable_state_dict
    from milestream.streams.weights.delta import DeltaSender

    cfg = run_config(folder, tmp_path / "run", lora_rank=4).with_overrides(
        weights={"transport": "disk-delta", "full_every": 3})
    model = load_model(cfg.model, dtype=torch.float32)
    producer, sender = RecordingProducer(), DeltaSender(cfg)
    for version in (1, 2, 3):  # a full version, then two deltas on it
        for tensor in trainable_state_dict(model).values():
            tensor.add_(0.01 * version)
        sender.publish(producer, version, version, trainable_state_dict(model))
    exported = export_version(cfg, tmp_path / "out")
    record = producer.records[-1]
    assert exported.source.endswith("v000003.delta") and record.base_version == 2
    assert exported.checksums == dict(zip(record.tensor_names, record.checksums))
    with torch.no_grad():
        torch.testing.assert_close(exported_logits(tmp_path / "out"), model(PROBE).logits, atol=1e-5, rtol=0)
