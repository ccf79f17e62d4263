"""The GPT-2 model itself, importable without any of the pipeline around it."""
