"""DVC stage `download` (see dvc.yaml): `gpt2 download` with the default paths."""

from gpt2.cli import main

if __name__ == "__main__":
    main(["download"], prog_name="stages.download")
