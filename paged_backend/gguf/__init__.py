"""GGUF files: their block formats, reading them quantized, writing random checkpoints of real
shapes."""

# The general.architecture values whose tensors we load into our modules as they are (the names
# `gguf.weights.hf_name` maps); other GGUF files go through transformers' conversion.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
