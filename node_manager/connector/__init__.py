"""Symphony's vLLM KV connector and its client of the node-local KV channel."""
