"""DVC stage `evaluate` (see dvc.yaml): `gpt2 evaluate` with the default paths."""

from gpt2.core.entry import run
from gpt2.eval.cli import evaluate

if __name__ == "__main__":
    run(evaluate, [], "stages.evaluate")
