"""DVC stage `train` (see dvc.yaml): `gpt2 train` with the default paths."""

from gpt2.cli import main

if __name__ == "__main__":
    main(["train"], prog_name="stages.train")
