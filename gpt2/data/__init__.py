"""The data stages: download raw text, tokenize it into token files, describe them (stats)."""
