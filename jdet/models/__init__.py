"""Models built on jdet's ops: ``llama`` (a Llama-style decoder with a KV cache) and
``parity`` (the RL sampler/trainer log-prob parity check run on it)."""
