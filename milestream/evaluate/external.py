"""``eval.mode: external``: the user's evaluator, given each due version as an HF-loadable folder.

The folder, ``RUN_DIR/eval/vNNNNNN``, holds what ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load with no milestream code: the policy with the version's LoRA
adapters merged into the base weights (fp32 ``model.safetensors`` and ``config.json``), the tokenizer, and
``milestream.json`` ({version, step, task}). The trainer's checkpoints are not that: they hold the
backend's state (optimizer included) every ``trainer.checkpoint_every`` steps, not every version.
Folders are written atomically; the newest ``eval.keep_exports`` are kept.

``eval.evaluator`` is the import path of ``fn(folder: Path) -> float | dict[str, float]``; a dict gives one
result per key, named ``eval.name/key``. It runs in a thread: on ``eval.timeout_s`` the version is
recorded as skipped and the loop goes on, while the late call finishes in the background.
"""
from __future__ import annotations

import asyncio
import copy
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from milestream.config import Config, import_path
from milestream.evaluate.evaluation import Score, require_skippable_transport
from milestream.infra.model import load_model, load_tokenizer, load_trainable_state_dict
from milestream.schemas.records import WeightVersion
from milestream.streams.weights import make_receiver
from milestream.train.export import save_hf_folder


class HFExporter:
    """Writes versions as HF model folders, from one fp32 copy of the policy kept across versions."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = load_model(cfg.model, dtype=torch.float32)
        self.tokenizer = load_tokenizer(cfg.model)
        self.root = cfg.run_path / "eval"

    def export(self, record: WeightVersion, tensors: Mapping[str, Tensor]) -> Path:
        load_trainable_state_dict(self.model, tensors)
        # merging changes the model in place; the copy keeps the adapters for the next version
        plain = copy.deepcopy(self.model).merge_and_unload() if self.cfg.model.lora_rank > 0 else self.model
        final = self.root / f"v{record.version:06d}"
        shutil.rmtree(final, ignore_errors=True)
        save_hf_folder(plain, self.tokenizer, final,
                       {"version": record.version, "step": record.step, "task": self.cfg.data.task})
        for old in sorted(self.root.glob("v*"))[:-self.cfg.eval.keep_exports]:
            shutil.rmtree(old, ignore_errors=True)
        return final


def scores_from(name: str, returned: Any, detail: str) -> list[Score]:
    """An evaluator's return value as scores: a number, or a non-empty dict of numbers."""
    items = [(f"{name}/{key}", value) for key, value in returned.items()] if isinstance(returned, Mapping) \
        else [(name, returned)]
    if not items or any(isinstance(v, bool) or not isinstance(v, (int, float)) for _, v in items):
        raise TypeError(f"eval.evaluator returned {returned!r:.200}; it must return a number or a dict of numbers")
    return [Score(key, float(value), detail) for key, value in items]


class ExternalEvaluation:
    def __init__(self, cfg: Config):
        require_skippable_transport(cfg)
        self.cfg = cfg
        self.evaluator = import_path(cfg.eval.evaluator, "eval.evaluator")
        self.receiver = make_receiver(cfg, "evaluator")
        self.exporter = HFExporter(cfg)

    async def __call__(self, record: WeightVersion) -> list[Score]:
        tensors = await asyncio.to_thread(self.receiver.receive, record)
        folder = await asyncio.to_thread(self.exporter.export, record, tensors)
        returned = await asyncio.to_thread(self.evaluator, folder)
        return scores_from(self.cfg.eval.name, returned, json.dumps({"folder": str(folder)}))

    async def close(self) -> None:
        self.receiver.close()
