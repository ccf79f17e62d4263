"""The GPT-2 BPE tokenizer, available offline.

``tiktoken.get_encoding("gpt2")`` downloads its ranks from a blob store that a
machine with only a package index cannot reach. The same ranks (sha256-equal
to tiktoken's pinned r50k_base file) ship inside the ``openai-whisper`` sdist
on the package index, so we fetch that archive with pip once, take the one
file out, check its hash and cache it. openai-whisper is never installed.
"""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path

import numpy as np

from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.data.pypi import cache_dir, fetch_sdist

NAME = "gpt2"
EOT_ID = 50256
VOCAB_SIZE = 50257
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
RANKS_SDIST = ("openai-whisper", "20250625", "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"


def ranks_file() -> Path:
    """Path of the verified GPT-2 ranks file in the cache, fetching it on first use."""
    cached = cache_dir() / "gpt2.tiktoken"
    if cached.is_file() and sha256_file(cached) == RANKS_SHA256:
        return cached
    sdist = fetch_sdist(*RANKS_SDIST)
    with tarfile.open(sdist) as archive:
        data = archive.extractfile(RANKS_MEMBER).read()
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
    tmp.write_bytes(data)
    if sha256_file(tmp) != RANKS_SHA256:
        tmp.unlink()
        raise UserError(f"{RANKS_MEMBER} in {sdist.name} has an unexpected sha256; delete {sdist} and retry")
    os.replace(tmp, cached)
    return cached


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """The GPT-2 ``tiktoken.Encoding``, checked against known ids before use."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    encoding = tiktoken.Encoding(
        name=NAME,
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(ranks_file()), expected_hash=RANKS_SHA256),
        special_tokens={"<|endoftext|>": EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )
    if encoding.encode("Hello world") != [15496, 995] or encoding.n_vocab != VOCAB_SIZE:
        raise UserError(f"the GPT-2 tokenizer built from {ranks_file()} fails its self-check; delete it and retry")
    return encoding


def token_byte_lengths() -> np.ndarray:
    """How many bytes of text each GPT-2 id stands for (uint16, one per id): what bits per byte divide by. The end
    of a document stands for none."""
    encoding = gpt2_encoding()
    lengths = np.zeros(VOCAB_SIZE, dtype=np.uint16)
    for token in range(VOCAB_SIZE):
        if token != EOT_ID:
            lengths[token] = len(encoding.decode_single_token_bytes(token))
    return lengths
