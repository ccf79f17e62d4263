"""What a training run holds in device memory, estimated without torch (`gpt2 plan` stays instant).

The memory model counts what this project's eager model (``gpt2/model/gpt.py``) keeps for the
backward pass, tensor by tensor, per token and layer (h = n_embd, a = n_head, T = sequence):

* fp32: LayerNorm inputs (2), attention and MLP linear inputs (1 + 1 + 1 + 4), q/k/v (3), the
  SDPA output (1) and GELU's input (4): 17·h floats = 68·h bytes. Manual attention keeps its T×T
  softmax instead of the SDPA output: 64·h + 4·a·T bytes.
* AMP (bf16/fp16 autocast): the residual stream and LayerNorm inputs stay fp32 (2 × 4·h), the rest
  are 16-bit copies: 38·h bytes; manual attention 34·h + 6·a·T (an fp32 softmax and its 16-bit copy).
* The head: ln_f's input and lm_head's input (8·h fp32, 6·h AMP), and the logits: the peak of the
  loss's backward holds about four vocabulary-wide tensors per token (16·V bytes fp32, 14·V AMP).
  The FP8 head (``train.fp8_head``) adds 2·V bytes per token: compiled, it holds every chunk's
  e5m2 loss gradient and its transposed copy at once.
* Weights, gradients and AdamW's two moments in fp32 (16 bytes per parameter), plus autocast's
  16-bit weight copies under AMP (2 bytes per parameter). Muon keeps one momentum buffer for the
  hidden matrices (12·L·h² parameters, 4 bytes each) and AdamW's two for the rest.
* FSDP (``shards`` ranks): weights, gradients and optimizer state are split over the ranks. What
  is not split is the unsharded working copy: the embedding group (wte = lm_head, wpe, ln_f),
  gathered for the whole forward and backward, and two blocks at a time (the one computing and the
  one prefetched), each with its full-size gradient until it is reduce-scattered. Under bf16 the
  gathered weights are bf16 already (``MixedPrecisionPolicy``, gpt2/train/sharded.py): no autocast
  copies. Without FSDP, autocast's 16-bit copies are cached for the whole forward: counted in full.

``tests/test_plan.py`` checks the activation count against the bytes autograd really saves and the
total against a measured peak. torch.compile fuses the loss and some activations away, and saves
others: compiled GPT-2 124M peaked 17% under the estimate at micro-batch 64 and 4% over it at 256.
Allocator caching and the CUDA context (~0.5 GB) are not included; the micro-batch search leaves
10% of the device's memory for them (``train.memory_margin`` of the free memory when the trainer
sizes its own micro-batch, gpt2/train/batch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpt2.core.errors import UserError
from gpt2.core.sizes import SIZES
from gpt2.core.sizes import pad_vocab as padded_size

VOCAB = 50257
GPU_CHUNK_ROWS = 8192  # train.loss_chunk auto on a GPU (gpt2/model/loss.py says why)
HEADROOM = 0.9  # share of device memory the plan fills; the rest is the CUDA context, allocator slack


@dataclass(frozen=True)
class Memory:
    """Bytes, for one micro-batch of ``batch`` sequences."""

    weights: float
    gradients: float
    optimizer: float
    weight_casts: float  # autocast's 16-bit copies of the weights
    unsharded: float  # fsdp: the full weights and gradients of the layers gathered at once
    activations: float  # what the layers save for backward
    logits: float  # the head's vocabulary-wide tensors at the loss's backward peak

    @property
    def total(self) -> float:
        return sum(asdict(self).values())


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    padded_vocab: int
    params: int  # all, tied embedding counted once
    params_without_wpe: int


def shape(size: str, pad_vocab: bool = True) -> Shape:
    if size not in SIZES:
        raise UserError(f"unknown model size {size!r}; one of {', '.join(SIZES)}")
    dims = SIZES[size]
    L, h, ctx = dims["n_layer"], dims["n_embd"], dims["block_size"]
    V = padded_size(VOCAB) if pad_vocab else VOCAB
    per_layer = 12 * h * h + 13 * h  # qkv, proj, fc, proj weights and biases; two LayerNorms
    without_wpe = V * h + L * per_layer + 2 * h  # tied wte/lm_head, blocks, ln_f
    return Shape(L, dims["n_head"], h, V, without_wpe + ctx * h, without_wpe)


def activation_bytes(s: Shape, batch: int, seq: int, amp: bool, flash: bool,
                     loss_chunk: int = 0, fp8_head: bool = False) -> tuple[float, float]:
    """(saved by the layers, the loss's peak) in bytes for one micro-batch.

    The plain loss holds about four vocabulary-wide tensors per token at its backward peak. The
    chunked one (``train.loss_chunk``, gpt2/model/loss.py) holds one chunk's fp32 logits, turned in
    place into the softmax gradient (and its 16-bit copy under AMP), the fp32 gradient of the hidden states (4·h per
    token) and the head's weight gradient three times over (its buffer, its scaled copy, and the sum
    with the embedding's gradient: 12·V·h, once)."""
    h, a, n, V = s.n_embd, s.n_head, batch * seq, s.padded_vocab
    if amp:
        per_layer = 38 * h if flash else 34 * h + 6 * a * seq
        head, logits = 6 * h, 14 * V
    else:
        per_layer = 68 * h if flash else 64 * h + 4 * a * seq
        head, logits = 8 * h, 16 * V
    saved = float(n * (s.n_layer * per_layer + head))
    if not loss_chunk:
        return saved, float(n * logits)
    rows = min(loss_chunk, n)
    fp8_gradients = 2 * V * n if fp8_head else 0
    return saved, float(rows * V * (6 if amp else 4) + n * 4 * h + (12 * V * h if n else 0) + fp8_gradients)


def hidden_matrices(s: Shape) -> int:
    """Parameters in the blocks' four weight matrices: what Muon (train/optim.py) optimizes."""
    return 12 * s.n_layer * s.n_embd * s.n_embd


def memory(s: Shape, batch: int, seq: int, amp: bool, flash: bool, loss_chunk: int = 0, optimizer: str = "adamw",
           shards: int = 1, fp8_head: bool = False) -> Memory:
    """Bytes on one device; ``shards`` > 1 is FSDP over that many ranks (DDP keeps a full replica: 1)."""
    saved, logits = activation_bytes(s, batch, seq, amp, flash, loss_chunk, fp8_head)
    muon = hidden_matrices(s) if optimizer == "muon" else 0
    unsharded = 0.0
    if shards > 1:
        block = 12 * s.n_embd * s.n_embd + 13 * s.n_embd
        embedding = s.params - s.params_without_wpe + s.padded_vocab * s.n_embd + 2 * s.n_embd
        # fp32 weights and gradients; under bf16, FSDP gathers bf16 weights and makes bf16 gradients, then
        # reduce-scatters them in fp32: 2 + 2 + 4 bytes, the same 8
        unsharded = 8.0 * (embedding + 2 * block)
    return Memory(weights=4.0 * s.params / shards, gradients=4.0 * s.params / shards,
                  optimizer=(4.0 * muon + 8.0 * (s.params - muon)) / shards,
                  # FSDP's mixed precision gathers the weights in bf16 already: autocast has nothing to copy
                  weight_casts=2.0 * s.params if amp and shards == 1 else 0.0, unsharded=unsharded,
                  activations=saved, logits=logits)


def largest_fitting(estimate: Callable[[int], float], budget: float) -> int:
    """The largest batch whose ``estimate`` (bytes) is within ``budget`` (0 if not even one)."""
    if estimate(1) > budget:
        return 0
    low, high = 1, 2
    while estimate(high) <= budget:
        low, high = high, high * 2
    while high - low > 1:  # the chunk makes the cost per sequence uneven: search, do not divide
        mid = (low + high) // 2
        low, high = (mid, high) if estimate(mid) <= budget else (low, mid)
    return low


def largest_micro_batch(s: Shape, seq: int, amp: bool, flash: bool, memory_gb: float, loss_chunk: int = 0,
                        optimizer: str = "adamw", shards: int = 1, fp8_head: bool = False) -> int:
    """The largest batch whose estimate fits ``HEADROOM`` of the memory (0 if not even one)."""
    return largest_fitting(lambda b: memory(s, b, seq, amp, flash, loss_chunk, optimizer, shards, fp8_head).total,
                           HEADROOM * memory_gb * 1e9)
