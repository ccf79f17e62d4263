"""DVC stage `download` (see dvc.yaml): `gpt2 download` with the default paths."""

from gpt2.core.entry import run
from gpt2.data.cli import download

if __name__ == "__main__":
    run(download, [], "stages.download")
