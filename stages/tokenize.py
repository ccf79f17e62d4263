"""DVC stage `tokenize` (see dvc.yaml): `gpt2 tokenize` with the default paths."""

from gpt2.cli import main

if __name__ == "__main__":
    main(["tokenize"], prog_name="stages.tokenize")
