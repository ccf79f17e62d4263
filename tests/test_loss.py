"""The chunked training loss against PyTorch's own lm_head + cross_entropy: same loss, same gradients."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpt2.model.gpt import GPT, gpt_config
from gpt2.model.head import Head
from gpt2.model.loss import linear_cross_entropy


def reference(hidden, weight, targets, mask):
    logits = hidden @ weight.t()
    if mask is not None:
        logits = logits + mask
    return F.cross_entropy(logits, targets)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_loss_and_gradients_equal_the_plain_path(chunk, masked):
    torch.manual_seed(0)
    n, c, v = 50, 16, 70
    hidden = torch.randn(n, c, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, c, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 64, (n,))
    mask = torch.cat([torch.zeros(64), torch.full((6,), float("-inf"))]).double() if masked else None
    ours = linear_cross_entropy(hidden, weight, targets, 64 if masked else None, chunk)
    (ours * 3.0).backward()  # a scaled loss (accumulation, GradScaler) scales both gradients
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected = reference(hidden, weight, targets, mask)
    (expected * 3.0).backward()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(got[0], hidden.grad, atol=1e-12) and torch.allclose(got[1], weight.grad, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_labels_too_unlikely_for_fp32_probabilities_keep_their_exact_loss(masked):
    """On a CPU in fp32 the loss comes from the softmax's probabilities, which underflow near 1e-38: a label
    less likely than 1e-30 (a loss above 69) is recomputed from its logits, so losses of hundreds stay exact."""
    torch.manual_seed(0)
    n, c, v = 24, 8, 70
    hidden = (40 * torch.randn(n, c)).requires_grad_()  # logits with a spread of hundreds
    weight = torch.randn(v, c, requires_grad=True)
    targets = torch.randint(0, 64, (n,))
    mask = torch.cat([torch.zeros(64), torch.full((6,), float("-inf"))]) if masked else None
    ours = linear_cross_entropy(hidden, weight, targets, 64 if masked else None, 8)
    ours.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected_rows = F.cross_entropy(hidden.double() @ weight.double().t() + (0 if mask is None else mask.double()),
                                    targets, reduction="none")
    assert expected_rows.max() > 200 and (expected_rows > 69).sum() > 5  # the case under test, several times
    expected_rows.mean().backward()
    assert ours.item() == pytest.approx(expected_rows.mean().item(), rel=1e-5)
    assert torch.allclose(got[0], hidden.grad.float(), atol=1e-5)
    assert torch.allclose(got[1], weight.grad.float(), atol=1e-5)


def test_without_gradients_only_the_loss_is_computed():
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(40, 8), torch.randn(30, 8), torch.randint(0, 30, (40,))
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, targets, None, 16).item() == pytest.approx(
            reference(hidden, weight, targets, None).item(), rel=1e-5)
        rows = linear_cross_entropy(hidden, weight, targets, None, 16, per_row=True)  # evaluation's per-window spread
        expected = F.cross_entropy(hidden @ weight.t(), targets, reduction="none")
        assert rows.shape == (40,) and torch.allclose(rows, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="evaluation"):
        linear_cross_entropy(hidden.requires_grad_(), weight, targets, None, 16, per_row=True)


def test_the_model_trains_the_same_without_holding_the_logits():
    """Same loss and gradients as the plain path (fp32), and nothing vocabulary-wide saved for backward."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}, 50257, True, "flash"))
    idx = torch.randint(0, 50257, (4, 16))
    _, plain = model(idx, idx)
    plain.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.set_head(Head(24))
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logits, chunked = model(idx, idx)
    chunked.backward()
    assert logits is None and chunked.item() == pytest.approx(plain.item(), rel=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-4, atol=1e-6), name
    vocab_wide = [shape for shape in saved if shape.numel() >= 64 * 50304]
    assert not vocab_wide  # the plain path saves (64, 50304) logits; the chunked one saves none


class LiveBuffers(TorchDispatchMode):
    """The most bytes held at once in storages of at least ``min_bytes``, counted as every operation starts and
    again once its output exists (its inputs still alive)."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes, self.live, self.most = min_bytes, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.most = max(self.most, sum(nbytes for nbytes, _ in self.live.values()))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.min_bytes:
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (storage.nbytes(), set()))[1].add(id(t))
                weakref.finalize(t, self.dead, storage.data_ptr(), id(t))
        self.most = max(self.most, sum(nbytes for nbytes, _ in self.live.values()))
        return out

    def dead(self, ptr: int, ident: int) -> None:
        _, holders = self.live.get(ptr, (0, set()))
        holders.discard(ident)
        if not holders:
            self.live.pop(ptr, None)


@pytest.mark.parametrize("autocast", [False, True])
def test_one_chunk_of_logits_is_alive_at_a_time(autocast):
    """The vocabulary-wide buffers alive at once are the ones the memory model counts: one chunk's fp32
    logits, and their bf16 copy under autocast. The next chunk's matmul starts after the last chunk's
    buffer is freed (on a CPU, two alternating 26 MB buffers cost the cache: docs/benchmarks.md)."""
    torch.manual_seed(0)
    n, c, v, chunk = 128, 8, 5000, 32  # the weight's gradient (v x c) is smaller than a bf16 chunk: not counted
    hidden, weight = torch.randn(n, c, requires_grad=True), torch.randn(v, c, requires_grad=True)
    with LiveBuffers(chunk * v * 2) as buffers, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        linear_cross_entropy(hidden, weight, torch.randint(0, v, (n,)), None, chunk).backward()
    assert buffers.most == chunk * v * (6 if autocast else 4)


@pytest.mark.skipif(not hasattr(torch, "get_autocast_dtype"), reason="needs torch >= 2.4")
def test_under_bf16_autocast_it_matches_the_plain_path_to_bf16_precision():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    targets = torch.randint(0, 100, (64,))
    with torch.autocast("cpu", torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets, None, 16)
        expected = F.cross_entropy(F.linear(hidden, weight), targets)
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(expected.item(), rel=2e-2)


def compiled_chunk(gemm: str, dim: int) -> tuple[list[str], float, float, str]:
    """One 64-row chunk of the loss under bf16 autocast, compiled: the vocabulary-wide buffers Inductor's code
    allocates (benchmarks/loss_kernels.py counts them at full size), its loss, the fp32 reference's, and the
    code."""
    import sys
    from pathlib import Path

    from torch._inductor.utils import run_and_get_code

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from loss_kernels import vocab_wide_buffers

    torch.manual_seed(0)
    hidden = torch.randn(64, dim, requires_grad=True)
    weight = torch.randn(256, dim, requires_grad=True)
    targets = torch.randint(0, 256, (64,))

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, targets, None, 64, gemm=gemm)
        loss.backward()
        return loss

    torch._dynamo.reset()
    loss, codes = run_and_get_code(torch.compile(step))
    reference = F.cross_entropy(hidden @ weight.t(), targets).item()
    code = "\n".join(codes)
    return sorted(vocab_wide_buffers(code, 64 * 256)), loss.item(), reference, code


@pytest.mark.skipif(not hasattr(torch, "get_autocast_dtype"), reason="needs torch >= 2.4")
def test_compiled_under_bf16_it_writes_no_fp32_logits():
    """Inductor fuses the softmax, the label column and the cast: a chunk's only vocabulary-wide buffers are
    the bf16 logits and their bf16 gradient."""
    buffers, loss, reference, _ = compiled_chunk("blas", 16)
    assert buffers == ["(64, 256) torch.bfloat16"] * 2
    assert loss == pytest.approx(reference, rel=2e-2)


def test_compiled_the_fp8_head_writes_its_loss_gradient_once_in_e5m2():
    """The FP8 head's softmax - one-hot goes from the bf16 logits straight to e5m2 in one fused kernel, with no
    fp32 probabilities between them (each fp32 copy is 8 bytes per logit element a chunk, about what the FP8
    matmuls save: docs/benchmarks.md), and its transposed copy for the weight's gradient. No value is
    reinterpreted as another dtype on the way: torch 2.11's Inductor (the lent GPU's) cannot lower a bool's
    bitcast, and failed to compile the FP8 head on an H100."""
    buffers, loss, reference, code = compiled_chunk("fp8", 32)
    assert buffers == ["(256, 64) torch.float8_e5m2", "(64, 256) torch.bfloat16", "(64, 256) torch.float8_e5m2"]
    assert "bit_cast" not in code
    assert loss == pytest.approx(reference, rel=5e-2)


@pytest.mark.parametrize("training", [True, False])
def test_compiled_every_chunk_gives_its_matmuls_the_same_autotune_key(training):
    """Inductor keys its autotuning on the inputs' offsets too: each chunk's matmuls read their rows at offset 0,
    not as a slice of the hidden states at the chunk's own offset (under max-autotune, one ~18 s autotune per
    chunk and matmul on an H100). The hidden states come from a layer norm, as in the model, so Inductor
    keeps them in one buffer that the slices would point into. (Evaluation's chunks get buffers of their own
    from their bf16 casts on a CPU anyway; training's are the ones a slice reached.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    hidden = torch.randn(32, 16, requires_grad=True)  # two chunks of 16 rows: the second would be a slice at 16
    weight = torch.randn(320, 16, requires_grad=True)
    targets = torch.randint(0, 320, (32,))

    def step():
        with torch.autocast("cpu", torch.bfloat16), torch.set_grad_enabled(training):
            loss = linear_cross_entropy(F.layer_norm(hidden, (16,)), weight, targets, None, 16, per_row=not training)
        if training:
            loss.backward()
        return loss

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(step))
    # per chunk: the logits, and in training the gradients of the hidden states and of the weight
    matmuls = [line for line in "\n".join(codes).splitlines() if "extern_kernels.mm(" in line]
    view = re.compile(r"reinterpret_tensor\(\w+, \([^)]*\), \([^)]*\), (\d+)\)")  # (buffer, size, stride, offset)
    offsets = {int(offset) for line in matmuls for offset in view.findall(line)}
    assert len(matmuls) == (3 if training else 1) * 2 and offsets <= {0}, matmuls


def test_auto_chunks_fit_a_cpu_cache_and_stay_large_on_a_gpu(monkeypatch):
    from gpt2.model import loss
    from gpt2.model.loss import chunk_rows

    monkeypatch.setattr(loss, "cpu_vendor", lambda: "GenuineIntel")
    assert chunk_rows("auto", "cpu", 50304) == 128  # 128 x 50,304 fp32 logits: 25.8 MB, within 32 MB
    assert chunk_rows("auto", "cpu", 1000) == 8192 and chunk_rows("auto", "cpu", 10**9) == 1
    assert chunk_rows("auto", "cuda", 50304) == 8192 and chunk_rows(0, "cpu", 50304) == 0
    assert chunk_rows(64, "cpu", 50304) == 64
    monkeypatch.setattr(loss, "cpu_vendor", lambda: "AuthenticAMD")  # MKL wants more rows per matmul there
    assert chunk_rows("auto", "cpu", 50304) == 512 and chunk_rows("auto", "cuda", 50304) == 8192
    assert chunk_rows(64, "cpu", 50304) == 64


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
@pytest.mark.parametrize("masked", [False, True])
def test_the_onednn_head_matmuls_give_the_blas_loss_and_gradients(masked):
    """train.cpu_gemm onednn: the logits (training and evaluation) and the gradients summed over four chunks from
    oneDNN's kernel, to fp32's precision."""
    torch.manual_seed(0)
    n, c, v = 50, 16, 70
    hidden = torch.randn(n, c, requires_grad=True)
    weight = torch.randn(v, c, requires_grad=True)
    targets = torch.randint(0, 64, (n,))
    figures = {}
    for gemm in ("blas", "onednn"):
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, targets, 64 if masked else None, 16, gemm=gemm)
        loss.backward()
        with torch.no_grad():
            rows = linear_cross_entropy(hidden, weight, targets, 64 if masked else None, 16, per_row=True, gemm=gemm)
        figures[gemm] = loss.item(), hidden.grad.clone(), weight.grad.clone(), rows
    (blas, *b), (onednn, *o) = figures["blas"], figures["onednn"]
    assert onednn == pytest.approx(blas, rel=1e-6)
    for got, expected in zip(o, b):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_the_head_weight_gradient_comes_back_in_the_weight_layout(gemm):
    """The loss hands autograd the weight's gradient row-major on every path: oneDNN sums it transposed, and a
    transposed gradient makes autograd add the tied embedding's gradient through strides, then copy the sum."""
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(70, 16, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 70, (50,)), None, 16, gemm=gemm)
    grad = torch.autograd.grad(loss, weight)[0]  # as the loss returned it: no AccumulateGrad copy in between
    assert grad.stride() == weight.stride()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
@pytest.mark.parametrize("bias", [False, True])
def test_a_onednn_linear_layer_computes_what_nn_linear_does(bias):
    """train.cpu_gemm onednn: the blocks' linear layers and the LM head, forward and backward, to fp32's precision;
    under autocast it is nn.Linear itself."""
    from gpt2.model.onednn import OnednnLinear, convert

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.transformer = torch.nn.Module()
    model.transformer.h = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias), torch.nn.LayerNorm(40))
    model.transformer.ln_f = torch.nn.Linear(4, 4)  # not a block's layer: stays nn.Linear
    model.lm_head = torch.nn.Linear(24, 40, bias=False)
    reference = torch.nn.Linear(24, 40, bias=bias)
    reference.load_state_dict(model.transformer.h[0].state_dict())
    assert convert(model) == ["transformer.h.0", "lm_head"] and type(model.transformer.h[0]) is OnednnLinear
    assert type(model.transformer.ln_f) is torch.nn.Linear
    x = torch.randn(3, 5, 24, requires_grad=True)
    results = []
    for layer in (model.transformer.h[0], reference):
        x.grad = None
        out = layer(x)
        out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
        results.append([out, x.grad, *(p.grad for p in layer.parameters())])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.transformer.h[0](x).dtype == torch.bfloat16


def test_cpu_gemm_auto_is_onednn_on_amd_only_and_a_missing_onednn_is_refused(monkeypatch):
    from gpt2.core.errors import UserError
    from gpt2.model import loss

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    for vendor, expected in (("AuthenticAMD", "onednn"), ("GenuineIntel", "blas"), ("", "blas")):
        monkeypatch.setattr(loss, "cpu_vendor", lambda vendor=vendor: vendor)
        assert loss.cpu_gemm("auto", "cpu") == expected, vendor
    assert loss.cpu_gemm("blas", "cpu") == "blas" and loss.cpu_gemm("onednn", "cuda") == "blas"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert loss.cpu_gemm("auto", "cpu") == "blas"
    with pytest.raises(UserError, match="cpu_gemm onednn: this PyTorch build has no oneDNN"):
        loss.cpu_gemm("onednn", "cpu")


class MatmulLog(TorchDispatchMode):
    """The FP8 matmuls a computation runs: their operands' dtypes, strides and shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            self.calls.append((a.dtype, b.dtype, a.stride(), b.stride(), a.shape, b.shape))
        return func(*args, **(kwargs or {}))


def test_the_fp8_head_follows_the_full_precision_loss_from_operands_cuda_can_take():
    """Three FP8 matmuls a chunk: e4m3 hidden states and weight for the logits; the e5m2 loss gradient against
    each for the two gradients; the first operand row-major and the second column-major, sizes multiples of 16
    (what CUDA's FP8 matmul requires). The loss follows fp32's to FP8's precision, the padding rows get no
    gradient, and without gradients (evaluation) nothing runs in FP8."""
    torch.manual_seed(0)
    n, c, v, vocab = 96, 32, 320, 300
    hidden = torch.randn(n, c, requires_grad=True)
    weight = (0.5 * torch.randn(v, c)).requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    results = {}
    for gemm in ("blas", "fp8"):
        hidden.grad = weight.grad = None
        with MatmulLog() as log:
            loss = linear_cross_entropy(hidden, weight, targets, vocab, 48, gemm=gemm)
        loss.backward()
        results[gemm] = loss.item(), hidden.grad.clone(), weight.grad.clone(), log.calls
    (full, *full_grads, none), (low, *low_grads, calls) = results["blas"], results["fp8"]
    assert none == [] and len(calls) == 3 * 2
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert [(a, b) for a, b, *_ in calls[:3]] == [(e4, e4), (e5, e4), (e5, e4)]
    for *_, a_stride, b_stride, a_shape, b_shape in calls:
        assert a_stride[1] == 1 and b_stride[0] == 1  # row-major, column-major
        assert all(size % 16 == 0 for size in (*a_shape, *b_shape))
    assert low == pytest.approx(full, rel=0.01) and low != full
    for got, expected in zip(low_grads, full_grads):
        assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99
    assert torch.all(low_grads[1][vocab:] == 0)
    with torch.no_grad(), MatmulLog() as log:
        evaluated = linear_cross_entropy(hidden, weight, targets, vocab, 48, gemm="fp8")
    assert log.calls == [] and evaluated.item() == pytest.approx(full, rel=1e-6)
