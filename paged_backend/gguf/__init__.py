"""GGUF files: their block formats, reading them quantized, writing random checkpoints of real
shapes."""
