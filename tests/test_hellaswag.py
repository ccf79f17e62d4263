"""eval.hellaswag: scored on a fixture in HellaSwag's exact JSON Lines format, against a reference
computed here one ending at a time (no batching, no padding, no masks)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random

import pytest
import torch
from conftest import make_tokens, micro_params, sentence

from gpt2.core.errors import UserError
from gpt2.data.tokenizer import gpt2_encoding
from gpt2.eval import hellaswag
from gpt2.eval.evaluate import evaluate
from gpt2.eval.loading import eval_runtime, load_model
from gpt2.train.trainer import train

BLOCK = 16  # the micro model's trained context (of its 32): the long item below is cut to its last tokens


def rows(n: int = 9, seed: int = 0) -> list[dict]:
    """Items shaped like hellaswag_val.jsonl's (every field it has), labels filled in later."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        ctx_a = " ".join(sentence(rng) for _ in range(1 if i != 4 else 12))  # item 4: longer than the context
        ctx_b = rng.choice(["he", "the king", "she then"])
        items.append({"ind": 24 + i, "activity_label": "Removing ice from car", "ctx_a": ctx_a, "ctx_b": ctx_b,
                      "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain", "label": 0,
                      "endings": [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))).lower() for _ in range(4)],
                      "source_id": f"activitynet~v_{i}"})
    return items


def reference(model: torch.nn.Module, item: dict) -> tuple[int, int]:
    """(argmin of summed ending loss, argmin of mean ending loss), one ending at a time."""
    encode = gpt2_encoding().encode_ordinary
    context = encode(item["ctx"])
    sums, means = [], []
    for ending in item["endings"]:
        ending_ids = encode(" " + ending)
        full = (context + ending_ids)[-(BLOCK + 1):]
        with torch.no_grad():
            logits = model.logits(model.hidden_states(torch.tensor([full[:-1]])))
        logp = torch.log_softmax(logits[0].double(), dim=-1)
        n = min(len(ending_ids), len(full) - 1)
        picked = [-float(logp[k - 1, full[k]]) for k in range(len(full) - n, len(full))]  # logits k-1 predict k
        sums.append(sum(picked))
        means.append(sum(picked) / n)
    return min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A trained micro checkpoint and a fixture whose labels make acc_norm exactly 5/9 and acc independent."""
    root = tmp_path_factory.mktemp("hellaswag")
    tokens = make_tokens(root / "tokens")
    train(micro_params(max_steps=10, eval_interval=10), tokens, root / "ckpt.pt", root / "reports")
    model = load_model(root / "ckpt.pt", eval_runtime("cpu", "fp32")).model
    items = rows()
    expected = [reference(model, item) for item in items]
    for i, (item, (_, by_mean)) in enumerate(zip(items, expected)):
        item["label"] = by_mean if i % 2 == 0 else (by_mean + 1) % 4
    (root / "hellaswag_val.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    acc = sum(by_sum == item["label"] for item, (by_sum, _) in zip(items, expected)) / len(items)
    return root, model, acc


def test_scores_match_one_ending_at_a_time(setup):
    root, model, acc = setup
    items = hellaswag.read_items(root / "hellaswag_val.jsonl", gpt2_encoding().encode_ordinary)
    assert max(len(i.context) for i in items) > BLOCK  # the long context is cut, as in the reference
    assert acc != pytest.approx(5 / 9)  # endings of unequal lengths: summed and mean loss pick differently
    for batch_items in (1, 4):
        result = hellaswag.score(model, items, BLOCK, torch.device("cpu"), contextlib.nullcontext, batch_items)
        assert result == {"acc_norm": pytest.approx(5 / 9), "acc": pytest.approx(acc), "items": 9}


def test_the_evaluate_stage_reports_it_and_limit_takes_the_first_items(setup, tmp_path):
    from gpt2.core.config import EvalConfig

    root, _, _ = setup
    cfg = EvalConfig(hellaswag=True, hellaswag_file=str(root / "hellaswag_val.jsonl"), max_new_tokens=4,
                     num_samples=1, prompts=("Hi",), mlflow=False)
    summary = evaluate(cfg, root / "ckpt.pt", root / "tokens", tmp_path / "eval")
    assert summary["hellaswag"]["acc_norm"] == pytest.approx(5 / 9)
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())["eval"]
    assert metrics["hellaswag_acc_norm"] == round(5 / 9, 4) and "hellaswag_acc" in metrics
    limited = evaluate(dataclasses.replace(cfg, hellaswag_limit=2), root / "ckpt.pt", root / "tokens",
                       tmp_path / "eval2")
    assert limited["hellaswag"]["items"] == 2 and limited["hellaswag"]["acc_norm"] == 0.5  # item 0 right, 1 wrong


@pytest.mark.parametrize("line, why", [
    ("{not json", "Expecting property name"),
    (json.dumps({"ctx": "a", "endings": ["b", "c", "d"], "label": 0}), "4 non-empty string endings"),
    (json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 7}), "a label 0-3"),
    (json.dumps({"endings": ["b", "c", "d", "e"], "label": 1}), "no field 'ctx'"),
])
def test_a_malformed_line_is_named(tmp_path, line, why):
    good = json.dumps(rows(1)[0])
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(UserError, match=rf"hellaswag_val\.jsonl line 3 is not a HellaSwag item \(.*{why}"):
        hellaswag.read_items(path, gpt2_encoding().encode_ordinary)


def test_offline_and_not_cached_says_how_to_get_the_file(monkeypatch, tmp_path):
    def unreachable(url, **kwargs):
        raise UserError(f"download of {url} failed after 4 attempts: Name or service not known; check the URL")

    monkeypatch.setattr("gpt2.data.http.download_url", unreachable)
    with pytest.raises(UserError, match=r"not cached and could not be downloaded .*download https://raw\."
                                        r"githubusercontent\.com/rowanz/hellaswag/.*eval\.hellaswag_file"):
        hellaswag.locate(None)
    with pytest.raises(UserError, match="eval.hellaswag_file: no such file"):
        hellaswag.locate(str(tmp_path / "missing.jsonl"))
