"""The GPT-2 tokenizer as Hugging Face files (vocab.json, merges.txt), built offline from the ranks.

tiktoken keeps GPT-2's BPE as ranks of byte strings; Hugging Face keeps the same BPE as a vocabulary
of byte-level unicode strings (GPT-2's bytes_to_unicode map) plus the ordered list of merges. The
merge that creates a token of rank r is found by running BPE on its bytes with the ranks below r:
it ends in exactly two parts. ``AutoTokenizer.from_pretrained`` on the result gives the same ids
as this pipeline's tokenizer (tested).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from gpt2.data.tokenizer import EOT_ID, ranks_file

EOT = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (encoder.py in openai/gpt-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def _text(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)))
        if best[0] >= rank:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} of rank {rank} does not split into two lower-ranked parts")
    return parts[0], parts[1]


def tokenizer_files() -> dict[str, str]:
    """File name → text of the Hugging Face GPT-2 tokenizer files."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(ranks_file()))
    vocab = {_text(token): rank for token, rank in ranks.items()}
    vocab[EOT] = EOT_ID
    merges = ["#version: 0.2"]
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _merge_of(token, rank, ranks)
            merges.append(f"{_text(left)} {_text(right)}")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "errors": "replace", **special}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False), "merges.txt": "\n".join(merges) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2), "special_tokens_map.json": json.dumps(special)}


def write_tokenizer(folder: Path) -> None:
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")
