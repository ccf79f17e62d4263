"""DVC stage `validate` (see dvc.yaml): `gpt2 validate`, before any stage can delete its outputs."""

from gpt2.core.entry import run
from gpt2.core.cli import validate

if __name__ == "__main__":
    run(validate, [], "stages.validate")
