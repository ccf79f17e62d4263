"""The evaluate stage (val loss, perplexity, samples) and text generation."""
