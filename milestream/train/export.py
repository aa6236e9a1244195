"""``milestream export``: a trained version taken away as a Hugging Face folder.

A version's weights stay on disk under the run folder in two places: the newest
``trainer.keep_weight_versions`` as version files of the weight transport (``RUN_DIR/weights``:
``vNNNNNN.safetensors``, or a disk-delta chain back to a full one), and the newest
``trainer.keep_checkpoints`` trainer checkpoints (``RUN_DIR/checkpoints/step_NNNNNN``, whose version
is their step). Either holds exactly the tensors a version's ``weights.versions`` record announced
(the trainable ones: LoRA adapters, or every weight), checked against their checksums here.

The folder holds what ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load with no milestream code: the base model with the version's tensors (LoRA merged into the base
weights, fp32), or with ``adapter`` the PEFT adapter alone (``PeftModel.from_pretrained`` on the
base); the tokenizer and its chat template; ``milestream.json`` (version, step, where the tensors came
from and their per-tensor xxh64, as on ``weights.versions``).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from milestream.config import Config, ConfigError, UserError
from milestream.infra.model import load_model, load_tokenizer, load_trainable_state_dict
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import checksums, version_of, weights_dir
from milestream.streams.weights.delta import DeltaReceiver, read_delta
from milestream.streams.weights.disk import read_verified_full
from milestream.train.backends.local import VALUE_HEAD
from milestream.train import checkpoint

FACTS_FILE = "milestream.json"


class VersionNotKept(UserError, LookupError):
    """The asked version's weights are no longer on disk (pruned) or never were."""


class ExportRefused(UserError, FileExistsError):
    """An --out folder that is not empty."""


@dataclass(frozen=True)
class Exported:
    folder: str
    version: int
    step: int
    source: str  # the version file or checkpoint folder the tensors came from
    merged: bool  # LoRA merged into the base weights (False: full fine-tuning, or the adapter alone)
    adapter: bool
    checksums: dict[str, str]  # per exported trainable tensor, as the version's weights.versions record


def kept_versions(run_dir: str | Path) -> dict[int, Path]:
    """Every version whose weights are still on disk: its version file, else its checkpoint."""
    kept = checkpoint.saved(run_dir)
    folder = weights_dir(run_dir)
    kept.update({version_of(p): p for p in [*folder.glob("v*.delta"), *folder.glob("v*.safetensors")]})
    return dict(sorted(kept.items()))


def version_tensors(cfg: Config, version: int | None = None) -> tuple[int, int, Path, dict[str, Tensor]]:
    """(version, step, source, its trainable tensors, verified) of ``version`` (None: the newest kept)."""
    kept = kept_versions(cfg.run.run_dir)
    if not kept:
        raise VersionNotKept(f"{cfg.run.run_dir} holds no weight version (no {weights_dir(cfg.run.run_dir)}/v*, "
                             f"no {checkpoint.checkpoint_root(cfg.run.run_dir)}/step_*)")
    version = max(kept) if version is None else version
    if version not in kept:
        raise VersionNotKept(
            f"version {version} of {cfg.run.run_dir} is no longer kept: it holds versions {sorted(kept)} "
            f"(version files: the newest trainer.keep_weight_versions={cfg.trainer.keep_weight_versions}; "
            f"checkpoints: the newest trainer.keep_checkpoints={cfg.trainer.keep_checkpoints})")
    source = kept[version]
    if source.is_dir():
        step, tensors = _from_checkpoint(source, version)
    elif source.suffix == ".delta":
        step, tensors = _from_delta(cfg, source, version)
    else:
        tensors = read_verified_full(source, version)
        step = _full_file_step(source)
    return version, step, source, tensors


def _from_checkpoint(folder: Path, version: int) -> tuple[int, dict[str, Tensor]]:
    payload = checkpoint.load(folder)
    state = payload["state"]
    if state["version"] != version:
        raise VersionNotKept(f"{folder} holds version {state['version']}, not {version}")
    prefix = f"{VALUE_HEAD}."  # the PPO value head trains with the policy but is no part of it
    return state["step"], {n: t for n, t in payload["backend"]["model"].items() if not n.startswith(prefix)}


def _from_delta(cfg: Config, path: Path, version: int) -> tuple[int, dict[str, Tensor]]:
    delta = read_delta(path)
    record = WeightVersion(version=version, step=delta.step, base_version=delta.base_version, transport="disk-delta",
                           location=str(path), tensor_names=[e["name"] for e in delta.entries],
                           checksums=[e["checksum"] for e in delta.entries], num_bytes=0, ts=0.0)
    return delta.step, DeltaReceiver(cfg, "export").receive(record)


def _full_file_step(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return int((handle.metadata() or {}).get("step", -1))


def export_version(cfg: Config, out: str | Path, version: int | None = None, adapter: bool = False) -> Exported:
    """Write ``version`` (None: the newest kept) of the run as an HF folder at ``out`` (which must not
    hold anything yet); ``adapter``: the LoRA adapter alone instead of merged weights."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportRefused(f"--out {out}: not empty; export writes a new folder")
    if adapter and cfg.model.lora_rank == 0:
        raise ConfigError("--adapter: this run fine-tuned every weight (model.lora_rank=0); there is no adapter")
    version, step, source, tensors = version_tensors(cfg, version)
    model = load_model(cfg.model, dtype=torch.float32)
    load_trainable_state_dict(model, tensors)
    merged = cfg.model.lora_rank > 0 and not adapter
    names, sums = checksums(tensors)
    exported = Exported(str(out), version, step, str(source), merged, adapter, dict(zip(names, sums)))
    save_hf_folder(model.merge_and_unload() if merged else model, load_tokenizer(cfg.model), out,
                   {**asdict(exported), "base": cfg.model.path or cfg.model.name})
    return exported


def save_hf_folder(model: nn.Module, tokenizer: PreTrainedTokenizerBase, folder: Path, facts: dict) -> None:
    """The model (or a PEFT model's adapter), tokenizer and ``facts`` as one folder, written atomically."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / FACTS_FILE).write_text(json.dumps(facts, indent=1))
    # safetensors writes its file with mode 0600 whatever the umask: every file gets the mode open() gave the
    # facts file under this process's umask, as the rest of the folder has
    mode = stat.S_IMODE((tmp / FACTS_FILE).stat().st_mode)
    for path in tmp.rglob("*"):
        if path.is_file():
            path.chmod(mode)
    if folder.exists():
        folder.rmdir()  # empty: checked by the caller
    os.replace(tmp, folder)

