"""Model-level optimisations: torchao quantization and torch.compile of the transformer."""
