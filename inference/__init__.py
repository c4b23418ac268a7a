"""Inference worker: a torch engine with a KV cache serving completions over HTTP,
swapping weights between decode steps and emitting one rollout record per completion."""
