"""DVC stage `train` (see dvc.yaml): `gpt2 train` with the default paths."""

from gpt2.train.cli import train

if __name__ == "__main__":
    train([], prog_name="stages.train")
