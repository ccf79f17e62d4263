"""GPT-2 pre-training pipeline: data, model, training and tracking as a library.

The DVC stages in ``stages/`` and the ``gpt2`` CLI are thin wrappers over it.
"""

__version__ = "0.1.0"
