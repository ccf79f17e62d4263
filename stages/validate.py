"""DVC stage `validate` (see dvc.yaml): `gpt2 validate`, before any stage can delete its outputs."""

from gpt2.core.cli import validate

if __name__ == "__main__":
    validate([], prog_name="stages.validate")
