"""The `gpt2` command line: every stage's command, one-line user errors with exit 2, `-S key=value`, and commands
run from a subfolder of the project."""

from __future__ import annotations

import json

import pytest

from conftest import write_params

from gpt2.cli import main
from gpt2.core.errors import UserError


def test_help_lists_every_stage(runner):
    out = runner.invoke(main, ["--help"]).output
    for name in ("download", "tokenize", "stats"):
        assert name in out


def test_full_chain_through_the_cli(runner, tmp_path, corpus):
    params = write_params(tmp_path / "p.yaml", download={"source": str(corpus)})
    raw, tokens, report = tmp_path / "raw", tmp_path / "tokens", tmp_path / "report"
    for args in (["download", "--out", raw], ["tokenize", "--raw", raw, "--out", tokens],
                 ["stats", "--tokens", tokens, "--out", report]):
        result = runner.invoke(main, [*map(str, args), "--params", str(params)])
        assert result.exit_code == 0, result.output
    assert json.loads((report / "metrics.json").read_text())["documents"] == 12
    # a folder that holds anything the command does not write is the user's: refused, and kept
    from conftest import micro_params, make_tokens

    from gpt2.train.trainer import train

    ckpt = tmp_path / "ckpt.pt"
    train(micro_params(max_steps=1), make_tokens(tmp_path / "micro"), ckpt, None)
    for name, args in (("raw", ["download", "--params", str(params), "--out"]),
                       ("tokens", ["tokenize", "--params", str(params), "--raw", str(raw), "--out"]),
                       ("export", ["export", str(ckpt)]), ("ladder", ["ladder", "--out"])):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "notes.txt").write_text("mine")
        result = runner.invoke(main, [*args, str(folder)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert (result.output.startswith(f"error: {folder} holds notes.txt, which ")
                and "does not write" in result.output)
        assert (folder / "notes.txt").read_text() == "mine"


def test_user_error_is_one_line_and_exit_2(runner, tmp_path):
    params = write_params(tmp_path / "p.yaml", tokenize={"workers": -1})
    result = runner.invoke(main, ["tokenize", "--params", str(params), "--out", str(tmp_path / "t")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: params: tokenize.workers = -1 is not allowed; expected an integer >= 0 (0 = all cores)"]
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("sections, message", [
    ({"model": {"n_head": 5}}, "model.n_head = 5 is not allowed; expected a divisor of the width, model.n_embd 128"),
    ({"train": {"block_size": 256}}, "train.block_size = 256 is not allowed; expected at most the model's context"),
    ({"train": {"batch_tokens": 1000}},
     "train.batch_tokens = 1000 is not allowed; expected a multiple of the sequence"),
    ({"train": {"batch_tokens": 2560, "micro_batch_size": 8}}, "train.micro_batch_size = 8 is not allowed; expected "
                                                               "auto or a divisor of the 20 sequences"),
    ({"train": {"init_from": "gpt3"}}, "train.init_from = 'gpt3' is not allowed; expected scratch, gpt2, gpt2-medium"),
    ({"train": {"device": "cuda"}}, "train.device cuda, but CUDA is not available here"),
])
def test_validate_refuses_what_the_train_stage_would_refuse(runner, tmp_path, sections, message):
    """Before DVC deletes any stage's outputs: the shapes and the device, from params alone."""
    import torch

    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    params = write_params(tmp_path / "p.yaml", **sections)
    result = runner.invoke(main, ["validate", "--params", str(params), "--out", str(tmp_path / "ok")])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "ok").exists()


def test_validate_names_the_settings_it_checked_and_what_yaml_made_of_a_bare_yes(runner, tmp_path, caplog):
    params = write_params(tmp_path / "p.yaml", train={"lr": 1.0e-3})
    args = ["validate", "--params", str(params), "--out", str(tmp_path / "ok")]
    assert runner.invoke(main, [*args, "-S", "train.lr=0.002"]).exit_code == 0
    assert f"validate: {params} is valid with -S train.lr=0.002" in caplog.text
    result = runner.invoke(main, [*args, "-S", "train.resume=yes"])
    assert result.exit_code == 2 and ("train.resume = True is not allowed; expected one of 'auto', 'never' (YAML reads "
                                      "a bare yes, no, on, off, true or false as a boolean)") in result.output
    result = runner.invoke(main, [*args, "-S", "train.micro_batch_size=yes"])
    assert result.exit_code == 2 and ("train.micro_batch_size = True has the wrong type; expected an integer or auto "
                                      "(YAML reads a bare yes") in result.output


def test_validate_refuses_a_local_source_that_is_not_there_where_download_will_run(tmp_path, monkeypatch):
    """Before DVC deletes data/raw to download again: a missing path or an empty pattern stops the pipeline; a
    source dvc.lock already records needs nothing (DVC keeps its download; a --temp copy lacks untracked folders),
    nor do the embedded corpus and remote sources."""
    from gpt2.core.cli import check_source

    monkeypatch.chdir(tmp_path)
    lock = tmp_path / "dvc.lock"
    with pytest.raises(UserError, match=r"download.source: no such file or directory 'corpus/mine' \(checked before "
                                        r"DVC deletes data/raw to download again\); use embedded.*`dvc add` it"):
        check_source("corpus/mine", lock)
    with pytest.raises(UserError, match=r"download.source: the pattern 'corpus/\*.txt' matched no files"):
        check_source("corpus/*.txt", lock)
    with pytest.raises(UserError, match=r"download.source: unsupported scheme in 's3://b/x'; use http\(s\)://"):
        check_source("s3://b/x", lock)  # the download stage's own words, before it deletes data/raw
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus/a.txt").write_text("text")
    for fine in ("corpus/a.txt", "corpus", "corpus/*.txt", "embedded", "hf:roneneldan/x",
                 "https://example.com/a.txt"):
        check_source(fine, lock)
    lock.write_text("stages:\n  download:\n    params:\n      params.yaml:\n        download:\n"
                    "          source: gone/\n")
    check_source("gone/", lock)  # downloaded before: the stage will not run for it
    with pytest.raises(UserError, match="no such file or directory 'gone/other'"):
        check_source("gone/other", lock)


def test_missing_params_file(runner, tmp_path):
    result = runner.invoke(main, ["stats", "--params", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_a_grid_setting_without_values_is_refused_before_anything_is_queued(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no DVC project here: the setting is checked first
    result = runner.invoke(main, ["grid", "-S", "train.lr"])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: -S 'train.lr': write section.key=value[,value...], e.g. -S train.lr=1.0e-3,2.0e-3")
    result = runner.invoke(main, ["grid", "-S", "lr=1e-3,2e-3"])  # a key one section has: that section named
    assert result.exit_code == 2 and result.output.strip() == (
        "error: -S 'lr=1e-3,2e-3': write section.key=value[,value...], did you mean -S train.lr=1e-3,2e-3?")
    result = runner.invoke(main, ["grid", "-S", "train.lr=1.0e-3"])  # a comma forgotten: one setting
    assert result.exit_code == 2 and "every -S gives one value, so the grid is one setting" in result.output
    result = runner.invoke(main, ["grid", "-S", "train.lr=1.0e-3,2.0e-3"])
    assert result.exit_code == 2 and "has no dvc.yaml; run from the project root" in result.output


def test_s_sets_one_key_for_this_run_and_is_checked_as_the_file_is(runner, tmp_path, tokens):
    from conftest import MICRO_MODEL, MICRO_TRAIN

    from gpt2.core import schema
    from gpt2.run import checkpoint

    params = write_params(tmp_path / "p.yaml", model=MICRO_MODEL, train=MICRO_TRAIN)
    before = params.read_text()
    common = ["--params", str(params), "--tokens", str(tokens), "--checkpoint", str(tmp_path / "ckpt.pt"),
              "--out", str(tmp_path / "r")]
    result = runner.invoke(main, ["train", *common, "-S", "train.max_steps=2", "-S", "train.eval_interval=2"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r/summary.json").read_text())["steps"] == 2
    assert checkpoint.load(tmp_path / "ckpt.pt")["params"]["train"]["max_steps"] == 2  # the run says what it used
    assert params.read_text() == before
    for sets, message in ((["train.max_stepz=2"], "unknown key 'train.max_stepz'; did you mean 'train.max_steps'?"),
                          (["train.lr=abc"], "train.lr"), (["max_steps=2"], "write section.key=value"),
                          (["train.lr.x=1"], "train.lr is a value, not a section")):
        result = runner.invoke(main, ["train", *common, *[a for s in sets for a in ("-S", s)]])
        assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert schema.override({"a": {"b": 1}}, ["a.c=[1, 2]", "d.e=x"]) == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": "x"}}


def test_commands_in_a_subfolder_read_and_write_the_projects_files(runner, tmp_path, tokens, monkeypatch):
    """As DVC does: `gpt2 sample` in docs/ finds checkpoints/ckpt.pt, and no second MLflow store starts there."""
    import shutil

    from conftest import MICRO_MODEL, MICRO_TRAIN

    from gpt2.run.mlflow_store import tracking_uri

    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "dvc.yaml").write_text("stages: {}\n")
    shutil.copytree(tokens, project / "data/tokens")
    write_params(project / "params.yaml", model=MICRO_MODEL, train={**MICRO_TRAIN, "max_steps": 2},
                 eval={"max_new_tokens": 3, "num_samples": 2, "device": "cpu"})
    monkeypatch.chdir(project / "docs")
    result = runner.invoke(main, ["train"])
    assert result.exit_code == 0, result.output
    assert (project / "checkpoints/ckpt.pt").is_file() and (project / "reports/train/summary.json").is_file()
    assert sorted(p.name for p in (project / "docs").iterdir()) == []
    assert tracking_uri() == f"sqlite:///{project.resolve()}/mlflow.db"
    result = runner.invoke(main, ["sample", "--prompt", "Hello"])  # the eval section's settings: two samples
    assert result.exit_code == 0 and result.output.count("Hello") == 2, result.output
    result = runner.invoke(main, ["sample", "Hello", "-S", "eval.num_samples=3"])  # the prompt as an argument
    assert result.exit_code == 0 and result.output.count("Hello") == 3, result.output
    for args, said in ((["sample", "Hello", "--prompt", "Hi"], "give the text to continue once, as PROMPT or "
                                                               "--prompt, not both ('Hello' and 'Hi')"),
                       (["sample"], "give the text to continue: gpt2 sample 'ROMEO:' (or --prompt 'ROMEO:')"),
                       (["sample", "Hello", "--temperature", "-1"], "--temperature (eval.temperature) -1.0 is not "
                                                                    "allowed; expected a number >= 0 (0 = greedy)"),
                       (["sample", "Hello", "-S", "eval.temperature=-1"], "params: eval.temperature = -1.0 is not")):
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and said in result.output, result.output
    result = runner.invoke(main, ["sample", "--prompt", "Hello", "-S", "eval.num_samples=3", "--num-samples", "1"])
    assert result.exit_code == 0 and result.output.count("Hello") == 1, result.output
    own = tmp_path / "own.pt"  # a path the user types is theirs, relative to where they are
    result = runner.invoke(main, ["sample", "--prompt", "Hello", "--checkpoint", "own.pt"])
    assert result.exit_code == 2 and "checkpoint own.pt not found" in result.output and not own.exists()
    elsewhere = tmp_path / "elsewhere"  # in no project: a missing default path says so, not "run tokenize"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for args, missing in ((["train"], "params file 'params.yaml'"),
                          (["train", "--params", str(project / "params.yaml")], "data/tokens/meta.json"),
                          (["sample", "--prompt", "Hello"], "checkpoint checkpoints/ckpt.pt")):
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert f"{missing} not found: {elsewhere.resolve()} is in no project (no dvc.yaml here or above); cd into " \
               "the project folder" in result.output
    assert not any(elsewhere.iterdir())


def test_a_flag_from_another_tool_or_a_spaced_setting_is_answered_with_how_settings_are_written(runner):
    """nanoGPT's `--max_iters=10` and `-S key value` are a newcomer's first tries: the usage error says -S."""
    said = runner.invoke(main, ["train", "--max-steps", "10"])
    assert said.exit_code == 2 and "\nerror: No such option '--max-steps'." in said.output  # as every error ends
    lr = runner.invoke(main, ["grid", "--lr", "0.1"])  # no near option of its own: the -S hint, no click guess
    assert lr.output.endswith("error: No such option '--lr'.\nSettings are given as -S section.key=value, e.g. -S "
                              "train.lr=VALUE (docs/params.md lists them).\n"), lr.output
    bogus = runner.invoke(main, ["--bogus"])  # the group's own options too
    assert bogus.exit_code == 2 and bogus.output.endswith("error: No such option '--bogus'.\n"), bogus.output
    assert "No such option '--max-steps'.\nSettings are given as -S section.key=value, e.g. -S train.max_steps=VALUE" \
        in said.output and "Did you mean" not in said.output
    said = runner.invoke(main, ["train", "--max_iters=10"])  # nanoGPT's name: ours
    assert "Settings are given as -S section.key=value; train.max_iters is nanoGPT's name; here it is " \
        "train.max_steps." in said.output
    assert "e.g. -S train.seed=VALUE" in runner.invoke(main, ["train", "--seed", "1"]).output  # tokenize has one too
    assert "e.g. -S train.max_steps=10 (docs" in runner.invoke(main, ["train", "--bogus"]).output  # no such key
    said = runner.invoke(main, ["grid", "--repeat", "2"])  # a near option of its own: click's guess alone
    assert "Did you mean" in said.output and "'--repeats'" in said.output and "Settings are given" not in said.output
    said = runner.invoke(main, ["grid", "--time-budget-s", "60"])  # a train key too, but the grid has the option
    assert "'--time-budget'" in said.output and "Settings are given" not in said.output
    said = runner.invoke(main, ["grid", "-S", "train.lr", "1.0e-3,2.0e-3"])
    assert said.exit_code == 2 and "-S takes section.key=value as one word, e.g. -S train.lr=1.0e-3" in said.output
    said = runner.invoke(main, ["train", "extra"])  # no -S came apart: click's words alone
    assert "unexpected extra argument" in said.output and "-S takes" not in said.output
    said = runner.invoke(main, ["plan", "--bogus"])  # a command without -S: click's own words alone
    assert "Settings are given" not in said.output and "-S takes" not in said.output
