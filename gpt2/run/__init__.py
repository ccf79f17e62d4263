"""What every run shares, whatever the stage: the checkpoint file, the device and its dtype, MLflow
tracking, FLOPs and peaks for MFU, and torch.compile's watch. The train stage, evaluate, export,
the ladder, the grid and ``gpt2 plan`` import from here; ``gpt2/train`` holds the train stage alone."""
