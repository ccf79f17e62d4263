"""DVC stage `evaluate` (see dvc.yaml): `gpt2 evaluate` with the default paths."""

from gpt2.cli import main

if __name__ == "__main__":
    main(["evaluate"], prog_name="stages.evaluate")
