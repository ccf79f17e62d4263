"""`gpt2 export` against the reference: transformers loads the directory and computes the same logits
and the same token ids as this pipeline."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import micro_params

from gpt2.cli import main
from gpt2.core.errors import UserError
from gpt2.data.tokenizer import gpt2_encoding
from gpt2.eval.export import export
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.model.hf import from_hf, to_hf
from gpt2.run import checkpoint
from gpt2.train.trainer import train

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def trained(tmp_path, tokens, **switches):
    train(micro_params(max_steps=2, **switches), tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    return tmp_path / "ckpt.pt"


@pytest.mark.parametrize("pad_vocab, attention", [(True, "flash"), (False, "manual")])
def test_transformers_loads_the_export_and_computes_the_same_logits(tmp_path, tokens, runner, pad_vocab, attention):
    ckpt = trained(tmp_path, tokens, model={"pad_vocab": pad_vocab, "attention": attention})
    result = runner.invoke(main, ["export", str(ckpt), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    state = checkpoint.load(ckpt)
    ours = GPT(GPTConfig(**state["model_config"]))
    ours.load_state_dict(checkpoint.clean_state_dict(state["model"]))
    ours.eval()
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(idx).logits
        logits, _ = ours(idx, idx)
    assert expected.shape == (2, 16, 50257)
    assert torch.allclose(logits[..., :50257], expected, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["vocab_size"] == 50257 and config["n_positions"] == 16  # trained on 16 of the model's 32


def test_autotokenizer_gives_the_pipelines_ids(tmp_path, tokens):
    export(trained(tmp_path, tokens), tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = gpt2_encoding()
    texts = ["Hello world", "ROMEO:\n  But, soft! what light through yonder window breaks?\n\n",
             "naïve café — 日本語 🙂 tabs\tand   spaces  ", "<|endoftext|> is special", "'s 're 've 'll 123 4567"]
    for text in texts:
        assert tokenizer.encode(text) == ours.encode(text, allowed_special="all"), text
    assert tokenizer.decode(ours.encode_ordinary(texts[2])) == texts[2]
    assert tokenizer.eos_token_id == 50256 and len(tokenizer) == 50257
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes  # model.safetensors readable like the rest (safetensors writes 0600)


def test_an_unfinished_run_and_a_replaced_export_are_said(tmp_path, tokens, caplog):
    state = checkpoint.load(trained(tmp_path, tokens))
    export(tmp_path / "ckpt.pt", tmp_path / "hf")
    assert "it replaced the model" not in caplog.text and "is an unfinished run" not in caplog.text
    state.update(metrics=None, step=1)  # as a run stopped at step 1 of 2 leaves it
    torch.save(state, tmp_path / "half.pt")
    export(tmp_path / "half.pt", tmp_path / "hf")
    assert "→ " + f"{tmp_path / 'hf'}/ (GPT2LMHeadModel" in caplog.text
    assert "; it replaced the model exported there before" in caplog.text
    assert (f"export: {tmp_path / 'half.pt'} is an unfinished run (step 1 of 2): the export holds its weights at that "
            "step; finish it (train.resume: auto) and export again") in caplog.text
    caplog.clear()
    state.update(step=2)  # a finished run's checkpoint written before checkpoints kept their summary
    torch.save(state, tmp_path / "half.pt")
    export(tmp_path / "half.pt", tmp_path / "hf")
    assert "is an unfinished run" not in caplog.text


def test_a_checkpoint_folder_names_the_file_to_pass(tmp_path, tokens):
    ckpt = trained(tmp_path, tokens)
    with pytest.raises(UserError, match=rf"checkpoint {ckpt.parent} is a folder \(ckpt.pt there\): pass the checkpoint "
                                        rf"file, e.g. {ckpt}"):
        export(ckpt.parent, tmp_path / "hf")


def test_weights_convert_both_ways_exactly():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50257, padded_vocab_size=50304)
    state = GPT(cfg).state_dict()
    back = from_hf(to_hf(state, cfg), cfg)
    for name, tensor in state.items():
        if name in ("transformer.wte.weight", "lm_head.weight"):  # tied; padded rows come back as zeros
            assert torch.equal(back[name][:50257], tensor[:50257]) and not back[name][50257:].any()
        else:
            assert torch.equal(back[name], tensor), name


def test_a_model_without_biases_is_refused_and_nothing_written(tmp_path, tokens):
    train(micro_params(model={"bias": False}, max_steps=2), tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    with pytest.raises(UserError, match="model.bias: false; Hugging Face's GPT-2 always has biases"):
        export(tmp_path / "ckpt.pt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- train.init_from


def reference_model(folder, safe: bool = True):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    if safe:
        model.save_pretrained(folder)
    else:  # the older PyTorch format (transformers 5 writes safetensors only)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


@pytest.mark.parametrize("pad_vocab, attention", [(True, "flash"), (False, "flash"), (True, "manual")])
def test_init_from_a_transformers_directory_gives_its_logits(tmp_path, tokens, pad_vocab, attention):
    from gpt2.train import trainer

    reference = reference_model(tmp_path / "hf")
    s = trainer.build(micro_params(init_from=str(tmp_path / "hf"),
                                   model={"pad_vocab": pad_vocab, "attention": attention}), tokens)
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(1))
    s.model.eval()
    with torch.no_grad():
        logits = s.model.logits(s.model.hidden_states(idx))
        expected = reference(idx).logits
    assert torch.allclose(logits[..., :50257], expected, atol=1e-5, rtol=0)
    assert s.init["init_from"] == str(tmp_path / "hf") and len(s.init["init_sha256"]) == 64


def test_init_from_a_pytorch_bin_trains_and_records_its_source(tmp_path, tokens):
    reference_model(tmp_path / "hf", safe=False)
    metrics = train(micro_params(init_from=str(tmp_path / "hf"), max_steps=2), tokens, tmp_path / "c.pt",
                    tmp_path / "r")
    assert metrics["runtime"]["init_file"].endswith("pytorch_model.bin") and metrics["steps"] == 2


def test_init_from_a_checkpoint_of_this_project_starts_from_its_weights(tmp_path, tokens):
    """`-S train.init_from=checkpoints/ckpt.pt`: a new run (step 0, its own optimizer and schedule) from the
    weights the checkpoint holds, as from its export; it crashed on the checkpoint's own key names."""
    from gpt2.run import checkpoint
    from gpt2.train import trainer

    train(micro_params(max_steps=4), tokens, tmp_path / "first/ckpt.pt", tmp_path / "first/reports")
    s = trainer.build(micro_params(init_from=str(tmp_path / "first/ckpt.pt")), tokens)
    saved = checkpoint.load(tmp_path / "first/ckpt.pt")["model"]
    rows = s.model_cfg.vocab_size  # the padded vocabulary rows are never looked up: the export drops them
    assert all(torch.equal(s.model.state_dict()[name][:rows], weights[:rows]) for name, weights in saved.items())
    assert s.init["init_from"] == str(tmp_path / "first/ckpt.pt")


def test_init_from_errors_name_the_cause(tmp_path, tokens):
    from gpt2.train import trainer

    reference_model(tmp_path / "hf")
    with pytest.raises(UserError, match=r"the weights have n_layer 2 \(model section: 3\), which the model section "
                                        r"\(model.size tiny\) contradicts"):
        trainer.build(micro_params(model={"n_layer": 3}, init_from=str(tmp_path / "hf")), tokens)
    with pytest.raises(UserError, match="is no such file or directory, nor one of scratch, gpt2"):
        trainer.build(micro_params(init_from=str(tmp_path / "nope")), tokens)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds neither model.safetensors nor pytorch_model.bin"):
        trainer.build(micro_params(init_from=str(tmp_path / "empty")), tokens)
    (tmp_path / "junk.safetensors").write_bytes(b"not weights")
    with pytest.raises(UserError, match="is not a readable weights file"):
        trainer.build(micro_params(init_from=str(tmp_path / "junk.safetensors")), tokens)


def test_init_from_a_name_offline_says_where_to_put_the_files(tmp_path, tokens, monkeypatch):
    from gpt2.train import trainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    # huggingface_hub reads both when imported (transformers imported it already): without this the test waits
    # for its connection timeouts, as a machine that is offline without saying so does
    hub = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    with pytest.raises(UserError, match=r"train.init_from gpt2: openai-community/gpt2 is neither in the Hugging Face "
                                        r"cache .* nor reachable .*`hf download openai-community/gpt2"):
        trainer.build(micro_params(init_from="gpt2"), tokens)


def test_evaluate_pretrained_offline_fails_at_once_naming_its_option(tmp_path, monkeypatch):
    """A machine offline without saying so (no HF_HUB_OFFLINE): one error line in seconds, not retries."""
    import time

    from gpt2.eval.loading import eval_runtime, load_pretrained_model

    hub = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.perf_counter()
    with pytest.raises(UserError, match=r"^eval.pretrained \(gpt2 evaluate --pretrained\) gpt2: .* nor reachable at "
                                        r"http://127.0.0.1:9; download it .*--local-dir hf-gpt2.* set "
                                        r"eval.pretrained .*to \./hf-gpt2"):
        load_pretrained_model("gpt2", eval_runtime("cpu", "fp32"))
    assert time.perf_counter() - started < 5


def test_evaluate_scores_a_pretrained_model_like_a_checkpoint(tmp_path, tokens, runner):
    """eval.pretrained: the val loss transformers itself computes on the same windows."""
    import numpy as np

    from gpt2.core.config import EvalConfig
    from gpt2.eval.evaluate import evaluate, windows

    reference = reference_model(tmp_path / "hf")
    cfg = EvalConfig(pretrained=str(tmp_path / "hf"), mlflow=False, max_new_tokens=4, num_samples=1,
                     prompts=("The king",), device="cpu")
    summary = evaluate(cfg, tmp_path / "no-checkpoint.pt", tokens, tmp_path / "eval")
    val = np.fromfile(tokens / "val.bin", dtype=np.uint16).astype(np.int64)
    total, count = 0.0, 0
    with torch.no_grad():
        for start, length in windows(len(val), 32, cfg.max_tokens, cfg.seed):
            ids = torch.from_numpy(val[start:start + length + 1])[None]
            total += reference(ids[:, :-1], labels=None).logits.log_softmax(-1)[0].gather(
                1, ids[0, 1:, None]).sum().item() * -1
            count += length
    assert summary["val"]["loss"] == pytest.approx(total / count, abs=1e-5)
    assert summary["pretrained"] == str(tmp_path / "hf")
    assert (tmp_path / "eval/samples.md").read_text().splitlines()[2].startswith(f"Pretrained {tmp_path / 'hf'}")
    result = runner.invoke(main, ["evaluate", "--pretrained", str(tmp_path / "nope"), "--out", str(tmp_path / "e2")])
    assert result.exit_code == 2 and "no such file or directory" in result.output
