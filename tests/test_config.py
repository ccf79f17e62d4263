"""params.yaml into checked dataclasses: defaults, unknown keys and sections, types, ranges, and the one-line
message for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpt2.core.config import DownloadConfig, ParamError, Params, TokenizeConfig, load_params
from gpt2.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def load(tmp_path: Path, text: str) -> Params:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return load_params(path)


def test_project_params_load_and_match_the_dataclass_defaults():
    params = load_params(ROOT / "params.yaml")
    assert params.download == DownloadConfig()
    assert params.tokenize == TokenizeConfig()


def test_missing_sections_take_defaults(tmp_path):
    assert load(tmp_path, "train: {}\n") == Params()  # an empty file is refused (below)


def test_unknown_key_names_key_and_suggests(tmp_path):
    with pytest.raises(ParamError, match=r"unknown key 'tokenize.val_fracton'; did you mean 'tokenize.val_fraction'"):
        load(tmp_path, "tokenize:\n  val_fracton: 0.1\n")


def test_unknown_section(tmp_path):
    with pytest.raises(ParamError, match=r"unknown key 'tokenise'"):
        load(tmp_path, "tokenise:\n  seed: 1\n")


@pytest.mark.parametrize("text, match", [
    ("tokenize:\n  seed: one\n", r"tokenize.seed = 'one'.*an integer"),
    ("tokenize:\n  seed: 1.5\n", r"tokenize.seed = 1.5.*an integer"),
    ("tokenize:\n  seed: true\n", r"tokenize.seed = True.*an integer"),
    ("download:\n  retries: [1]\n", r"download.retries = \[1\].*an integer"),
    ("download:\n  source: 3\n", r"download.source = 3.*a string"),
    ("tokenize:\n  on_decode_error: ignore\n", r"on_decode_error = 'ignore'.*'replace', 'strict'"),
    ("download:\n  timeout_s: 1e-1x\n", r"download.timeout_s = '1e-1x' is not allowed; expected a number"),
])
def test_wrong_type(tmp_path, text, match):
    with pytest.raises(ParamError, match=match):
        load(tmp_path, text)


def test_a_float_in_the_form_dvc_writes_it_is_a_float(tmp_path):
    """`dvc exp run -S train.lr=3.0e-5` writes `lr: 3e-05` into params.yaml (YAML 1.2), which PyYAML reads as text:
    the stage reads the number DVC meant, from the file and from a -S."""
    params = load(tmp_path, "train:\n  lr: 3e-05\n  min_lr: 1E-6\n  betas: [0.9, 9.5e-1]\n")
    assert (params.train.lr, params.train.min_lr, params.train.betas) == (3e-05, 1e-06, (0.9, 0.95))
    (tmp_path / "p.yaml").write_text("train:\n  lr: 1.0e-3\n")
    assert load_params(tmp_path / "p.yaml", ("train.min_lr=3e-05",)).train.min_lr == 3e-05


@pytest.mark.parametrize("value", ["0", "0.0", "0.6", "-0.1", "1"])
def test_val_fraction_outside_range(tmp_path, value):
    with pytest.raises(ParamError, match=r"tokenize.val_fraction = .*\(0, 0.5\]"):
        load(tmp_path, f"tokenize:\n  val_fraction: {value}\n")


def test_val_fraction_upper_bound_allowed(tmp_path):
    assert load(tmp_path, "tokenize:\n  val_fraction: 0.5\n").tokenize.val_fraction == 0.5


def test_int_is_accepted_for_float(tmp_path):
    assert load(tmp_path, "download:\n  timeout_s: 5\n").download.timeout_s == 5.0


def test_bad_sha256(tmp_path):
    with pytest.raises(ParamError, match="download.sha256.*64 hex digits"):
        load(tmp_path, "download:\n  sha256: abc\n")


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_params(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, message", [
    ("download: [\n", r"not valid YAML: line 2, column 1: expected the node content, but found '<stream end>'$"),
    ("train:\n  lr: [1, 2\n  min_lr: 2\n", r"not valid YAML: line 3, column 9 \('min_lr: 2'\): expected ',' or ']', "
                                          r"but got ':', while parsing a flow sequence begun on line 2$"),
    ("train:\n\tlr: 1\n", r"line 2, column 1 \('lr: 1'\): found character '\\t' that cannot start any token; YAML "
                         r"indents with spaces, not tabs$"),
    ("train:\n  time_budget_s:\n    lr: 1.0e-3\n", r"params: train.lr is indented under train.time_budget_s, so YAML "
                                                 r"reads it as train.time_budget_s's value \(\{'lr': 0.001\}\); "
                                                 r"indent it as train's other keys$"),
])
def test_invalid_yaml_is_one_line_naming_where(tmp_path, text, message):
    """PyYAML's six lines become one: the line, its text and what is wrong; a key indented under an empty one is
    named, not blamed on the key above it."""
    with pytest.raises(UserError, match=message) as raised:
        load(tmp_path, text)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("text, message", [
    ("train:\n  lr: 1.0e-3\n  max_steps: 10\n  lr: 2.0e-3\n",
     r": the key 'lr' is written twice \(lines 2 and 4\): keep one$"),
    ("train: {}\neval: {}\ntrain: {}\n", r"the key 'train' is written twice \(lines 1 and 3\)"),
    ("", r"is empty: it must hold the stages' sections"),
    ("# all commented out\n", r"is empty"),
])
def test_a_key_written_twice_or_an_empty_file_is_refused(tmp_path, text, message):
    """PyYAML would keep the last of two values silently, and an empty file would train on every default."""
    with pytest.raises(UserError, match=message):
        load(tmp_path, text)


def test_section_must_be_mapping(tmp_path):
    with pytest.raises(ParamError, match="tokenize must be a mapping"):
        load(tmp_path, "tokenize: 3\n")


def test_bare_off_is_the_off_choice(tmp_path):
    """YAML 1.1 (and `dvc exp run -S train.distributed=off`) reads off as false."""
    assert load(tmp_path, "train:\n  distributed: off\n").train.distributed == "off"


def test_several_processes_need_ddp(tmp_path):
    with pytest.raises(ParamError, match="train.nproc_per_node = 2.*unless train.distributed is ddp"):
        load(tmp_path, "train:\n  nproc_per_node: 2\n")
    assert load(tmp_path, "train:\n  distributed: ddp\n  nproc_per_node: 2\n").train.nproc_per_node == 2


@pytest.mark.parametrize("text, match", [
    ("train:\n  optimizer: sgd\n", r"train.optimizer = 'sgd'.*'adamw', 'muon'"),
    ("train:\n  muon_lr: 0.0\n", r"train.muon_lr = 0.0.*> 0"),
    ("train:\n  muon_momentum: 1.0\n", r"train.muon_momentum = 1.0.*\[0, 1\)"),
    ("train:\n  muon_weight_decay: -0.1\n", r"train.muon_weight_decay = -0.1.*>= 0"),
    ("train:\n  target_val_loss: -1.0\n", r"train.target_val_loss = -1.0.*null or a number > 0"),
    ("eval:\n  hellaswag_limit: 0\n", r"eval.hellaswag_limit = 0.*null or an integer >= 1"),
    ("eval:\n  unigram_max_tokens: 0\n", r"eval.unigram_max_tokens = 0.*null or an integer >= 1"),
    ("download:\n  hf_gzip_level: 10\n", r"download.hf_gzip_level = 10.*\[0, 9\]"),
])
def test_this_waves_keys_are_range_checked(tmp_path, text, match):
    with pytest.raises(ParamError, match=match):
        load(tmp_path, text)


@pytest.mark.parametrize("key", ["attention", "pad_vocab"])
def test_a_model_switch_in_its_old_train_place_names_the_new_key(tmp_path, key):
    with pytest.raises(ParamError, match=rf"train.{key} is now model.{key}: move it there"):
        load(tmp_path, f"train:\n  {key}: true\n")
    assert getattr(load(tmp_path, f"model:\n  {key}: {'manual' if key == 'attention' else 'false'}\n").model, key) in (
        "manual", False)


@pytest.mark.parametrize("text, match", [
    ("train:\n  betas: [0.9, 1.0]\n", r"train.betas = \[0.9, 1.0\].*2 numbers in \[0, 1\)"),
    ("eval:\n  top_p: 0.0\n", r"eval.top_p = 0.0.*a number in \(0, 1\] \(1.0 = off\)"),
    ("train:\n  grad_clip: -1.0\n", r"train.grad_clip = -1.0.*a number >= 0 \(0 = off\)"),
    ("train:\n  min_lr: 0.5\n", r"train.min_lr = 0.5.*\[0, train.lr\]"),
    ("train:\n  max_tokens: 100\n", r"train.max_tokens = 100.*exactly one of train.max_steps, train.max_tokens and "
                                      r"train.time_budget_s set .*max_steps and max_tokens are both set"),
    ("train:\n  time_budget_s: 60.0\n", r"train.time_budget_s = 60.0.*max_steps and time_budget_s are both set \(to "
                                          r"keep time_budget_s: -S train.max_steps=null, or null in params.yaml\)"),
    ("train:\n  max_steps: null\n  time_budget_s: 0.0\n", r"train.time_budget_s = 0.0.*a number > 0"),
    ("train:\n  max_steps: null\n", r"train.max_steps = None.*exactly one of"),
    ("train:\n  price_per_hour: -1.0\n", r"train.price_per_hour = -1.0.*a number >= 0"),
    ("train:\n  price_per_hour: .inf\n", r"train.price_per_hour = inf.*a finite number \(.inf and .nan are YAML's"),
    ("train:\n  betas: [0.9, .nan]\n", r"train.betas\[1\] = nan.*a finite number"),
])
def test_declared_ranges_and_cross_checks_name_the_key(tmp_path, text, match):
    with pytest.raises(ParamError, match=match):
        load(tmp_path, text)


def test_eval_iters_names_its_replacement(tmp_path):
    with pytest.raises(ParamError, match=r"train.eval_iters was replaced by train.eval_windows.*whatever the "
                                         r"micro-batch and the ranks.*train.eval_windows: 80"):
        load(tmp_path, "train:\n  eval_iters: 10\n")


def test_a_peers_name_for_a_key_says_ours_and_a_failed_dvc_exp_run_says_how_to_take_it_out(tmp_path, monkeypatch):
    """nanoGPT's learning_rate is no near miss of lr: the error names lr. Where `dvc exp run -S` wrote the key into
    the workspace's params.yaml (not --temp's copy), DVC leaves it there after the failed run: the error says so."""
    for key, ours in (("learning_rate", "train.lr"), ("max_iters", "train.max_steps"),
                      ("gradient_accumulation_steps", "train.grad_accum_steps")):
        with pytest.raises(ParamError, match=rf"train.{key} is .*; here it is {ours}$"):
            load(tmp_path, f"train:\n  {key}: 1\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    with pytest.raises(ParamError, match=r"here it is train.lr \(if `dvc exp run -S` wrote it there, it stays after "
                                         r"the failed run: `git checkout HEAD -- params.yaml` takes it out\)"):
        load_params((tmp_path / "params.yaml").write_text("train:\n  learning_rate: 1\n") and "params.yaml")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "elsewhere"))  # --temp: the workspace's file is untouched
    with pytest.raises(ParamError, match=r"here it is train.lr$"):
        load_params("params.yaml")


@pytest.mark.parametrize("text, match", [
    ("train:\n  max_steps: 99999999999999999999\n", r"train.max_steps = 99999999999999999999 .*\[1, 1e\+09\]"),
    ("train:\n  lr: 3.0\n  min_lr: 0.0\n", None),  # high, but a value someone may mean
    ("train:\n  lr: 60.0\n", r"train.lr = 60.0 is not allowed"),
])
def test_typos_that_would_run_for_ever_are_out_of_range(tmp_path, text, match):
    if match is None:
        load(tmp_path, text)
        return
    with pytest.raises(ParamError, match=match):
        load(tmp_path, text)


def test_plan_refuses_a_number_that_is_not_one(runner):
    from gpt2.cli import main

    for value in ("nan", "inf"):
        result = runner.invoke(main, ["plan", "--model", "gpt2", "--tokens", value])
        assert result.exit_code == 2 and f"'{value}' is not a finite number" in result.output
