"""HellaSwag (validation split, 10,042 items): pick the right ending of a sentence, by completion loss.

Scored as build-nanogpt and llm.c do it: each of the 4 endings (with its leading space) is appended
to the context, the model's cross-entropy is summed over the ending's tokens only, and the ending
with the lowest loss wins. ``acc`` uses the summed loss; ``acc_norm`` the loss per token (longer
endings are not penalized), the figure people quote: OpenAI's GPT-2 124M gets 0.2955, random 0.25.
A context longer than the model's window keeps its last tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gpt2.core import log
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress
from gpt2.model.gpt import GPT

logger = log.get("evaluate")

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"


@dataclass(frozen=True)
class Item:
    context: list[int]
    endings: list[list[int]]
    label: int


def read_items(path: Path, encode: Any, limit: int | None = None) -> list[Item]:
    """The JSON Lines file (``ctx``, ``endings``, ``label`` per line) as token ids; a bad line is named."""
    items = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                context, endings, label = row["ctx"], row["endings"], row["label"]
                if not (isinstance(context, str) and isinstance(endings, list) and len(endings) == 4
                        and all(isinstance(e, str) and e for e in endings) and label in range(4)):
                    raise ValueError("needs a string ctx, 4 non-empty string endings and a label 0-3")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                what = exc.msg if isinstance(exc, json.JSONDecodeError) else (
                    f"no field {exc}" if isinstance(exc, KeyError) else str(exc))
                raise UserError(f"{path} line {number} is not a HellaSwag item ({what}); download the file again "
                                f"(delete it: it is fetched from {URL})") from None
            items.append(Item(encode(context), [encode(" " + e) for e in endings], int(label)))
    if not items:
        raise UserError(f"{path} holds no HellaSwag items; delete it so that it is downloaded again")
    return items


def locate(local: str | None) -> Path:
    """``eval.hellaswag_file`` if set, else the validation file downloaded once into the cache
    (``~/.cache/gpt2-pipeline/downloads``) through the project's HTTP downloader."""
    from gpt2.data.http import download_url

    if local is not None:
        if not Path(local).is_file():
            raise UserError(f"eval.hellaswag_file: no such file {local!r}; download {URL} there, or set it to null")
        return Path(local)
    try:
        return download_url(URL)
    except UserError as exc:
        raise UserError(f"eval.hellaswag: the HellaSwag validation set is not cached and could not be downloaded "
                        f"({str(exc).split(';')[0]}); on a machine with internet, download {URL} and set "
                        "eval.hellaswag_file to its path (or set eval.hellaswag: false)") from None


@torch.no_grad()
def score(model: GPT, items: list[Item], block: int, device: torch.device, autocast: Any,
          batch_items: int = 4) -> dict[str, Any]:
    """acc, acc_norm and the number of items, in batches of ``batch_items`` items (4 rows each)."""
    correct = correct_norm = 0
    with Progress("hellaswag", total=len(items), unit=" items") as progress:
        for lo in range(0, len(items), batch_items):
            batch = items[lo:lo + batch_items]
            rows, ending_lengths = [], []
            for item in batch:
                for ending in item.endings:
                    rows.append((item.context + ending)[-(block + 1):])  # the window's last block + 1 tokens
                    ending_lengths.append(min(len(ending), len(rows[-1]) - 1))
            width = max(len(r) for r in rows)
            tokens = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)  # which targets belong to an ending
            for i, (row, n) in enumerate(zip(rows, ending_lengths)):
                tokens[i, :len(row)] = torch.tensor(row)
                mask[i, len(row) - 1 - n:len(row) - 1] = True
            tokens = tokens.to(device)
            x, y = tokens[:, :-1], tokens[:, 1:]
            with autocast():
                logits = model.logits(model.hidden_states(x))  # every position's: each ending's tokens are scored
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape).cpu()
            summed = (losses * mask).sum(1).view(-1, 4)
            mean = summed / mask.sum(1).view(-1, 4)
            labels = torch.tensor([item.label for item in batch])
            correct += int((summed.argmin(1) == labels).sum())
            correct_norm += int((mean.argmin(1) == labels).sum())
            progress.update(len(batch))
    n = len(items)
    logger.info(f"hellaswag: acc_norm {correct_norm / n:.4f}, acc {correct / n:.4f} over {n:,} items")
    return {"acc_norm": correct_norm / n, "acc": correct / n, "items": n}
