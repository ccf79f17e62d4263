"""DVC stage `train` (see dvc.yaml): `gpt2 train` with the default paths. The evaluate stage's outputs
(persistent, so DVC leaves them) are withdrawn once they describe a replaced checkpoint."""

from gpt2.core.entry import run
from gpt2.core.paths import EVAL_REPORTS
from gpt2.train.cli import train

if __name__ == "__main__":
    run(train, ["--evaluation", EVAL_REPORTS], "stages.train")
