"""Memory estimation: a model's shape (from GGUF headers or safetensors + config.json), engine
rules (llama.cpp, vLLM) and the breakdown the console shows. Pure: files in, dataclasses out."""
