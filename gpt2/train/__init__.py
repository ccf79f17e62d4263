"""The train stage: the loop and everything it runs on (device, loader, optimizer, checkpoints, DDP, tracking)."""
