"""DVC stage `stats` (see dvc.yaml): `gpt2 stats` with the default paths."""

from gpt2.core.entry import run
from gpt2.data.cli import stats

if __name__ == "__main__":
    run(stats, [], "stages.stats")
