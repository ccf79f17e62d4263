"""DVC stage `tokenize` (see dvc.yaml): `gpt2 tokenize` with the default paths."""

from gpt2.core.entry import run
from gpt2.data.cli import tokenize

if __name__ == "__main__":
    run(tokenize, [], "stages.tokenize")
