"""A user evaluator for the external-evaluation test, loaded by import path (``eval.evaluator``)."""
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROBE = "2 + 3 ="


def fails_on_version_2(folder: Path) -> dict[str, float]:
    """Loads the folder with plain transformers and scores a fixed probe; crashes on version 2."""
    version = json.loads((folder / "milestream.json").read_text())["version"]
    if version == 2:
        raise RuntimeError("this evaluator fails on version 2 on purpose")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        logits = model(**tokenizer(PROBE, return_tensors="pt")).logits
    return {"version": float(version), "probe_logit": float(logits[0, -1].max())}
