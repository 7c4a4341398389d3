"""Token-step generation: Llama-family models over a paged KV cache, a sampler and a tokenizer."""
