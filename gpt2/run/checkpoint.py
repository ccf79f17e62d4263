"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint holds the model (without torch.compile's ``_orig_mod.`` prefix),
the optimizers, the GradScaler, the step, every rank's RNG states (python,
numpy, torch, cuda), the batch sampler's position, the configuration and the
history of logged measures (train/saving.py writes it). Loading never
shows a traceback from inside torch: a damaged file is reported as such, with
what to do. Files of an older layout are brought up to date in one place,
``upgrade``, so the rest of the code reads one layout.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.core.atomic import atomic_file
from gpt2.core.errors import UserError

FORMAT = "gpt2-checkpoint/2"
OLDER_FORMATS = ("gpt2-checkpoint/1",)
COMPILED_PREFIX = "_orig_mod."


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile's wrapper prefix so the weights load into a plain model."""
    return {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}


def non_finite(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors that hold NaN or inf."""
    return [name for name, w in weights.items() if w.is_floating_point() and not bool(torch.isfinite(w).all())]


def trained_length(state: dict[str, Any]) -> int:
    """The sequence length the checkpoint trained on. ``train.block_size`` may be shorter than the model's
    context; the positions past it never got a gradient. Older checkpoints say it through their params."""
    if "seq_len" in state:
        return int(state["seq_len"])
    return int(state["params"]["train"].get("block_size") or state["model_config"]["block_size"])


def trained_model(state: dict[str, Any], path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The model's config and weights cut to the trained positions: what evaluation, sampling and export use,
    so none of them reads a position embedding that training never fed. Weights with NaN or inf (flipped bits,
    a diverged run) are refused here, not found later as a NaN loss and a crash in sampling."""
    length = trained_length(state)
    weights = clean_state_dict(state["model"])
    bad = non_finite(weights)
    if bad:
        raise UserError(f"checkpoint {path} holds NaN or inf weights ({len(bad)} tensors, {bad[0]} first): the file "
                        "is damaged or its run diverged; restore a good copy or retrain")
    wpe = "transformer.wpe.weight"
    if wpe in weights and length < weights[wpe].shape[0]:
        weights = {**weights, wpe: weights[wpe][:length]}
    return {**state["model_config"], "block_size": min(length, state["model_config"]["block_size"])}, weights


def rng_states() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this process's device only: a state per visible GPU would not restore on a machine with fewer
        states["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    name, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"], torch.cuda.current_device())


@contextlib.contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """Hold the checkpoint's folder for one training at a time: two runs writing one checkpoint would
    each resume from and overwrite the other's steps. An OS lock on the folder itself (no lock file
    inside a DVC output); the OS drops it when the process dies, so a crash never leaves it stale."""
    folder = Path(path).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no flock; run one training per checkpoint yourself
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another training is using {Path(path)} (its folder is locked); wait for it to "
                            "finish, or give this run its own --checkpoint path") from None
        yield
    finally:
        os.close(fd)


def save(path: str | os.PathLike, state: dict[str, Any]) -> None:
    with atomic_file(path) as tmp:
        torch.save({"format": FORMAT, **state}, tmp)


def to_cpu(obj: Any, copies: dict[tuple, torch.Tensor] | None = None) -> Any:
    """A copy of ``obj`` whose tensors are CPU copies: what the next optimizer step cannot change. Tensors that
    view the same memory (a tied embedding and LM head) share one copy, so the file holds it once, as
    ``torch.save`` of the live state would."""
    copies = {} if copies is None else copies
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())
        if key not in copies:
            copies[key] = obj.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(obj, dict):
        return {k: to_cpu(v, copies) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v, copies) for v in obj)
    return obj


class BackgroundSaver:
    """Checkpoints written on a thread while training goes on.

    ``save`` copies the state to the CPU first (a device-to-host copy: a fraction of a second for
    GPT-2 124M) so the file is exactly that step's, then writes it atomically in the background:
    the seconds of serializing 1.5 GB do not stall the step. One write at a time: the next
    ``save`` waits for the previous one. ``wait`` raises a failed write's error (disk full) in
    the training thread. With ``enabled`` false it writes in place, in the training thread."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        self.wait()
        if not self.enabled:
            self._write(path, state)  # in this thread; a failure is raised by the next wait(), as a background one
            return
        snapshot = to_cpu(state)
        self._thread = threading.Thread(target=self._write, args=(path, snapshot), name="checkpoint-writer")
        self._thread.start()

    def _write(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        try:
            save(path, state)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._error = exc

    @property
    def busy(self) -> bool:
        """A write is still going on."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's files are zip archives (since PyTorch 1.6)
PICKLE_MAGIC = b"\x80"  # an older torch.save's, a bare pickle


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint onto the CPU, or raise :class:`UserError` saying why it cannot be used."""
    path = Path(path)
    if path.is_dir():
        files = sorted(f.name for f in path.glob("*.pt"))
        inside = f" ({', '.join(files[:3])} there)" if files else " (no .pt file there)"
        raise UserError(f"checkpoint {path} is a folder{inside}: pass the checkpoint file, e.g. "
                        f"{path / (files[0] if files else 'ckpt.pt')}")
    if not path.is_file():
        from gpt2.core.paths import CHECKPOINT, not_found, root

        default = path.resolve() == (root() / CHECKPOINT).resolve()
        raise UserError(not_found(f"checkpoint {path}", "train first (dvc repro train)" if default else
                                  f"pass the path of one (training writes {CHECKPOINT})", "--checkpoint PATH"))
    with path.open("rb") as file:
        head = file.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC and head[:1] != PICKLE_MAGIC:
        raise UserError(f"{path} is not a checkpoint: " + (
            "it is empty" if not head else f"it begins {head!r}, where torch.save's files begin {ZIP_MAGIC!r}")
            + "; pass one that gpt2 train wrote, or, if this was one, it is damaged: restore a good copy or delete it")
    try:
        with warnings.catch_warnings():  # a damaged header reads as an unknown pickle protocol: the error below says it
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # damaged bytes surface as any error of the unpickler's (IndexError, KeyError, ...)
        raise UserError(f"checkpoint {path} is corrupt or truncated (torch.load raised {exc.__class__.__name__}); "
                        "delete it to start over or restore a good copy") from None
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, *OLDER_FORMATS):
        raise UserError(f"{path} is not a checkpoint of this pipeline (format {FORMAT!r} expected); "
                        "point to a checkpoint written by gpt2 train")
    return upgrade(state)


# Format 1 named the plot columns in its history rows; format 2 keeps every measure under its one name.
_V1_MEASURES = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "step_ms": "perf/step_ms",
                "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "val_loss": "val/loss"}


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint in format 2's layout: one optimizer state became a list (Muon and AdamW),
    one RNG state a list per rank, and the history's rows name each measure as MLflow does."""
    if state["format"] == FORMAT:
        return state
    if not isinstance(state["optimizer"], list):
        state["optimizer"] = [state["optimizer"]]
    rngs = state.pop("rng_per_rank", None) or [state["rng"]]
    for rng in rngs:
        if not isinstance(rng.get("cuda", torch.empty(0)), torch.Tensor):
            del rng["cuda"]  # one state per visible GPU: only restorable on a machine with as many
    state["rng_per_rank"] = rngs
    state.pop("rng", None)
    state.setdefault("world_size", 1)
    memory = "mem/allocated_gb" if "cuda" in rngs[0] else "mem/rss_gb"
    history = state["history"]
    for rows in (history["train"], history["val"]):
        rows[:] = [{_V1_MEASURES.get(k, memory if k == "mem_gb" else k): v for k, v in row.items()} for row in rows]
    state["format"] = FORMAT
    return state
