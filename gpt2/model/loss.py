"""The training loss without the logits: LM head and cross-entropy, a few thousand rows at a time.

GPT-2 124M at micro-batch 64 × 1024 has 65,536 positions × 50,304 vocabulary entries: the plain
path (``lm_head`` then ``F.cross_entropy``) keeps those logits, their fp32 copy and their gradient
alive through backward, about 16 bytes × V per token (52 GB). Training needs only the loss and the
gradients, so here each chunk of rows gets its logits, its softmax, and at once its share of the
gradients for the hidden states and the head's weight; the next chunk's logits then overwrite them. Peak
memory for the head drops to one chunk's logits plus the N × C gradient of the hidden states; the
work is the same three matmuls (forward, and the two of backward, done in forward).

Precision follows autocast as the plain path does: matmuls in the autocast dtype, the softmax in
fp32. The gradient's 1/N is applied in fp32 after the matmuls, so fp16 does not underflow it.

Each chunk's logits become their log-softmax in place (one row-wise pass), then the softmax gradient
in place (``exp_``); on a CPU in fp32, eager, they become the softmax in place at once, one exp per
logit (``probs_in_place``; compiled, Inductor fuses the passes anyway). Without compile a chunk
needs one fp32 buffer. On a CPU that buffer is sized to stay in cache between the matmul that writes
it and the two that read it (``chunk_rows``); the matmuls then run near the CPU's peak and the
softmax passes cost far less than on logits that spill to memory, except on AMD CPUs, where the
matmuls need more rows than the cache holds (docs/benchmarks.md). Under torch.compile Inductor fuses
the softmax, the exp and the cast into one pass: bf16 on a GPU moves about 12 to 14 bytes per logit
(the matmul writes 2, the log-sum-exp reads 2 or 4, the gradient kernel reads 2 and writes 2, the
two gradient matmuls read 2 + 2). Scattering the label column's -1 into fp32 probabilities and
casting after would make Inductor write and read them in fp32 first: about 20.
``benchmarks/loss_kernels.py`` shows the buffers the compiled chunk allocates and times it.
"""

from __future__ import annotations

import math

import torch

from gpt2.core.cpu import cpu_vendor
from gpt2.core.errors import UserError
from gpt2.core.memory_model import GPU_CHUNK_ROWS
from gpt2.model.fp8 import HeadFp8


CPU_CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk: small enough for a server CPU's caches
AMD_CHUNK_BYTES = 128 * 2**20  # on AMD CPUs MKL needs more rows per matmul than the cache holds
LOG_TINY = -69.0  # log(1e-30): a label's probability below it is recomputed, as fp32 underflows near 1e-38
AUTOCAST_DEVICES = ("cuda", "cpu", "mps", "xpu")  # torch.is_autocast_enabled raises for others (meta)


def precision(hidden: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the matmuls compute in, the softmax's and the sums'): autocast's where it is on, else the
    input's; and that one promoted to fp32 at least."""
    device_type = hidden.device.type
    on = device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)
    compute = torch.get_autocast_dtype(device_type) if on else hidden.dtype
    return compute, torch.promote_types(compute, torch.float32)


def chunk_rows(setting: int | str, device_type: str, vocab_size: int) -> int:
    """``train.loss_chunk`` on this device: ``auto`` is 8192 positions on a GPU, where big matmuls run
    best. On a CPU a chunk is sized so that its fp32 logits stay in cache from the matmul that writes
    them through the softmax and the two matmuls that read them: a power of two whose logits fit in
    32 MB (128 positions at GPT-2's vocabulary). On an AMD CPU the matmuls weigh more than the cache:
    MKL's kernels there run the head's shapes 15-30% slower at 128 rows than at 512, and with oneDNN
    (``cpu_gemm: auto`` there) each chunk adds its share into the weight's gradient in a pass of its
    own, which fewer chunks pay less often; so the chunk is the power of two whose logits fit in
    128 MB (512 positions). docs/benchmarks.md has the measurements behind each."""
    if setting != "auto":
        return int(setting)
    if device_type != "cpu":
        return GPU_CHUNK_ROWS
    budget = AMD_CHUNK_BYTES if cpu_vendor() == "AuthenticAMD" else CPU_CHUNK_BYTES
    return 2 ** max(0, math.floor(math.log2(budget / (4 * vocab_size))))


@torch.library.custom_op("gpt2::own_copy", mutates_args=())
def own_copy(rows: torch.Tensor) -> torch.Tensor:
    """A copy of a chunk's rows in a buffer of its own, for a compiled graph.

    A chunk's rows are a slice of the hidden states, at an offset that differs from chunk to chunk, and the
    offset is part of the key Inductor caches its autotuning under (``select_algorithm.key_of``). Under
    ``max-autotune`` the matmuls on a slice would be autotuned anew for every chunk, each taking seconds for
    GPT-2's head on a GPU: minutes of compile for the same shapes. A copy at offset 0 gives every chunk the same key.
    Inductor folds a plain ``clone`` of the same shape away, but not an opaque operator. The copy is one pass
    over the chunk's rows (C wide), small beside its matmuls (V wide)."""
    return rows.clone()


@own_copy.register_fake
def _(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(rows)


def rows_of(x: torch.Tensor, lo: int, chunk: int) -> torch.Tensor:
    """A chunk's rows of ``x``: a slice, or under compile its copy at offset 0 (``own_copy``)."""
    rows = x[lo:lo + chunk]
    return own_copy(rows) if torch.compiler.is_compiling() else rows


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                vocab_size: int | None, chunk: int, gemm: str = "blas") -> torch.Tensor:
        compute, acc = precision(hidden)
        x, w = hidden.to(compute), weight.to(compute)
        n = x.shape[0]
        total = torch.zeros((), device=hidden.device, dtype=acc)
        grad_hidden = torch.empty(x.shape, device=hidden.device, dtype=acc)
        grad_weight = None
        head8 = HeadFp8(weight) if gemm == "fp8" else None
        gemm = logits_gemm(gemm, compute)
        in_place = x.device.type == "cpu" and compute == acc and head8 is None and not torch.compiler.is_compiling()
        buffer = logits_buffer(x, w, chunk, compute, acc) if gemm == "blas" and head8 is None else None
        for lo in range(0, n, chunk):
            rows, labels = rows_of(x, lo, chunk), targets[lo:lo + chunk]
            at_labels = (torch.arange(len(labels), device=x.device), labels)
            if head8 is not None:
                logits, rows8 = head8.logits(rows, compute)
                logp = masked_log_softmax(logits.to(acc), vocab_size)
                picked = logp.gather(1, labels[:, None]).squeeze(1)
                # softmax - one-hot in one expression, no scatter: compiled, one pass from the logits to e5m2
                one_hot = torch.arange(logp.shape[1], device=x.device) == labels[:, None]
                # a conversion, not a dtype view: torch 2.11's Inductor cannot lower a bool's bitcast
                g = logp.exp_().sub_(one_hot.to(torch.uint8))
                del logits, logp, one_hot
            elif in_place:
                logits = onednn_mm(rows, w) if gemm == "onednn" else torch.mm(rows, w.t(), out=buffer[:len(rows)])
                g, picked = probs_in_place(logits, rows, w, at_labels, vocab_size)
                del logits
            else:
                logp = log_probs(rows, w, vocab_size, acc, buffer, gemm)
                picked = logp.gather(1, labels[:, None]).squeeze(1)
                g = logp.exp_().to(compute)  # the softmax, cast once to the matmul dtype
                del logp
            total -= picked.sum()
            if head8 is not None:  # g is softmax - one-hot already: a scatter here would cost its one fused pass
                grad_hidden[lo:lo + chunk], part = head8.grads(g, rows8)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            else:  # d(loss sum)/d(logits) = softmax - one-hot, the label column from its fp32 log-probability
                g[at_labels] = (picked.exp() - 1.0).to(g.dtype)
                grad_hidden[lo:lo + chunk], grad_weight = head_grads(g, rows, w, grad_weight, gemm, acc)
            del g  # under autocast, g is a copy: freed before the next chunk's matmul allocates its logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.meta = (hidden.dtype, weight.dtype, n)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype, n = ctx.meta
        scale = grad_loss / n  # the mean's 1/N in fp32 after the matmuls, so fp16 does not underflow it
        weight_grad = scaled_row_major(grad_weight, scale, weight_dtype)
        return (grad_hidden * scale).to(hidden_dtype), weight_grad, None, None, None, None


def head_grads(g: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, grad_weight: torch.Tensor | None,
               gemm: str, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's share of the head's gradients from its loss gradient ``g``: ``g @ weight`` (its rows' hidden
    states) and ``g.T @ rows`` added into ``grad_weight`` (None for the first chunk), summed in ``acc``."""
    if gemm == "onednn":  # g's transpose and the weight's as strided views: oneDNN reads them in place
        part = onednn_mm(rows.t().contiguous(), g.t()).t()  # computed as its transpose, (C, V)
        return onednn_mm(g, weight.t()), part if grad_weight is None else grad_weight.add_(part)
    if grad_weight is None:
        grad_weight = (g.t() @ rows).to(acc)
    elif rows.dtype == acc:
        grad_weight.addmm_(g.t(), rows)  # the sum inside the matmul: no second pass over the V x C buffer
    else:
        grad_weight += g.t() @ rows
    return g @ weight, grad_weight


def scaled_row_major(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad × scale`` in ``dtype``, laid out as its parameter is (row-major), in one pass. oneDNN's path sums
    the head's weight gradient as the transpose of a (C, V) buffer. Handed to autograd that way, it costs twice:
    the tied embedding's gradient is added into it through strides, then the sum is copied into the weight's
    layout (12 and 5 ms of the tiny CPU step under AVX2). Transposed here, while it is scaled (3 ms), both are
    plain."""
    return torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def logits_buffer(x: torch.Tensor, weight: torch.Tensor, chunk: int, compute: torch.dtype,
                  acc: torch.dtype) -> torch.Tensor | None:
    """One buffer that every chunk's logits are written into, where the matmul computes in ``acc``.

    A new buffer per chunk lands at another address each time. On a CPU that costs the cache the
    chunk was sized for: the step ran 3% slower (docs/benchmarks.md). Under autocast the matmul
    writes 16-bit logits, which are then cast, so there is nothing to reuse (None)."""
    if compute != acc:
        return None
    return torch.empty(min(chunk, x.shape[0]), weight.shape[0], device=x.device, dtype=acc)


def logits_gemm(setting: str, compute: torch.dtype) -> str:
    """Where ``cpu_gemm``'s choice of oneDNN applies: its fp32 kernel (every CPU has one), in eager code (a
    compiled graph keeps Inductor's own choice of matmul); else the BLAS path, ``blas`` (also for ``fp8``,
    which only the training loss's gradient path takes: evaluation stays in full precision)."""
    onednn = setting == "onednn" and compute == torch.float32 and not torch.compiler.is_compiling()
    return "onednn" if onednn else "blas"


def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T`` (``+ bias``) in fp32 through oneDNN's kernel (``train.cpu_gemm onednn``). Either operand may
    be a transposed view: oneDNN reads its strides, where a copy would cost a pass over the chunk."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def probs_in_place(logits: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                   at_labels: tuple[torch.Tensor, torch.Tensor],
                   vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's ``logits`` (``rows @ weight.T``) turned into its softmax in place, and the labels'
    log-probabilities, on a CPU in fp32.

    One exp per logit where the log-softmax then its exp take two: 7% of the tiny step on a CPU
    (docs/benchmarks.md). The labels' log-probabilities come from their probabilities, which lose
    nothing above 1e-30; a row whose label is less likely than that (a loss above 69) has its
    log-softmax recomputed from its logits, so the loss stays exact where fp32 probabilities underflow."""
    probs = logits
    if vocab_size is not None and vocab_size < probs.shape[1]:
        probs[:, vocab_size:] = float("-inf")
    torch.softmax(probs, dim=-1, out=probs)
    picked = probs[at_labels].log()
    unlikely = (picked < LOG_TINY).nonzero().squeeze(1)
    if len(unlikely):
        exact = log_probs(rows[unlikely], weight, vocab_size, probs.dtype)
        picked[unlikely] = exact[torch.arange(len(unlikely)), at_labels[1][unlikely]]
    return probs, picked


def log_probs(rows: torch.Tensor, weight: torch.Tensor, vocab_size: int | None, acc: torch.dtype,
              buffer: torch.Tensor | None = None, gemm: str = "blas") -> torch.Tensor:
    """Log-softmax of ``rows @ weight.T`` in ``acc``, with the padded columns (from ``vocab_size`` on) at -inf;
    written into ``buffer`` (``logits_buffer``) where there is one. ``gemm``: the matmul's library
    (``logits_gemm``)."""
    if gemm == "onednn":
        logits = onednn_mm(rows, weight)
    elif buffer is not None:
        logits = torch.mm(rows, weight.t(), out=buffer[:len(rows)])
    else:
        logits = (rows @ weight.t()).to(acc)
    return masked_log_softmax(logits, vocab_size)


def masked_log_softmax(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Log-softmax of ``logits`` in place (one chunk-sized buffer, not two), the padded columns (from
    ``vocab_size`` on) at -inf: padding takes no probability mass."""
    if vocab_size is not None and vocab_size < logits.shape[1]:
        logits[:, vocab_size:] = float("-inf")
    return torch.log_softmax(logits, dim=-1, out=logits)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         vocab_size: int | None = None, chunk: int = 8192, per_row: bool = False,
                         gemm: str = "blas") -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, never holding all the logits.

    ``hidden``: (N, C), ``weight``: (V, C), ``targets``: (N,) ids. Columns from ``vocab_size`` on are
    padding (GPT-2's 50,257 tokens padded to 50,304 rows): they get no probability. Without gradients
    (evaluation) only the loss is computed, chunk by chunk; ``per_row`` returns each row's loss,
    shape (N,), instead of their mean (evaluation only). ``gemm``: ``cpu_gemm``'s choice for the logits'
    matmul (``blas`` off a CPU), or ``fp8`` (``train.fp8_head``): the training loss's three matmuls from
    FP8 operands (``model/fp8.py``'s ``HeadFp8``), evaluation in full precision.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        if per_row:
            raise ValueError("per_row losses are for evaluation: call under torch.no_grad()")
        return LinearCrossEntropy.apply(hidden, weight, targets, vocab_size, chunk, gemm)
    compute, acc = precision(hidden)
    gemm = logits_gemm(gemm, compute)
    buffer = logits_buffer(hidden, weight, chunk, compute, acc) if gemm == "blas" else None
    losses = torch.cat([-log_probs(rows_of(hidden, lo, chunk), weight, vocab_size, acc, buffer, gemm)
                        .gather(1, targets[lo:lo + chunk, None]).squeeze(1) for lo in range(0, hidden.shape[0], chunk)])
    return losses if per_row else losses.mean()


def cpu_gemm(setting: str, device_type: str, key: str = "train.cpu_gemm") -> str:
    """The library for the LM-head matmuls (``train.cpu_gemm``, ``eval.cpu_gemm``: ``key``, named in the message
    where oneDNN is missing), the step's largest, and the other linear layers (``model/onednn.py``): ``blas``
    (PyTorch's BLAS: MKL on x86) or ``onednn`` (oneDNN's kernels, JIT-compiled for the CPU it runs on).
    MKL picks its kernels by the CPU's vendor: on an AMD CPU with AVX-512 its fp32 kernels run these shapes at
    half the chip's rate, where oneDNN's run them about twice as fast and the tiny step 1.75 times
    (docs/benchmarks.md); on an Intel CPU MKL runs at the chip's rate. ``auto``: oneDNN on an AMD CPU, BLAS
    elsewhere; off a CPU always the device's own. Only fp32 matmuls take oneDNN (under bf16 autocast a CPU
    without native bf16 has no oneDNN kernel for them)."""
    if device_type != "cpu":
        return "blas"
    available = onednn_available()
    if setting == "onednn" and not available:
        raise UserError(f"{key} onednn: this PyTorch build has no oneDNN; set {key}: auto or blas")
    if setting == "auto":
        return "onednn" if available and cpu_vendor() == "AuthenticAMD" else "blas"
    return setting


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's fp32 linear kernel (``onednn_mm``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def liger_loss(device: torch.device):
    """Liger-Kernel's fused linear + cross-entropy (``train.loss_kernel: liger``), called as ``loss(weight,
    hidden, targets)``: Triton kernels that compute each chunk's logits, their softmax and its gradients in
    place, as ``LinearCrossEntropy`` does with torch's kernels. CUDA only."""
    if device.type != "cuda":
        raise UserError(f"train.loss_kernel liger runs Triton kernels on CUDA only, and this run is on {device.type}; "
                        "set train.loss_kernel: torch (the chunked loss)")
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise UserError("train.loss_kernel liger needs liger-kernel, which is not installed here: pip install "
                        "liger-kernel (or set train.loss_kernel: torch)") from None
    # Dynamo cannot trace its addmm(out_dtype=...) on torch 2.11 (a fake-tensor TypeError, seen on an H100): under
    # torch.compile it runs as it is, between two graphs
    return torch.compiler.disable(LigerFusedLinearCrossEntropyLoss())
