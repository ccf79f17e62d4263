"""DVC stage `stats` (see dvc.yaml): `gpt2 stats` with the default paths."""

from gpt2.cli import main

if __name__ == "__main__":
    main(["stats"], prog_name="stages.stats")
