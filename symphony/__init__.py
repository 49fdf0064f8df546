"""Symphony: KV-cache state manager and router for multi-turn LLM serving."""

__version__ = "0.1.0"
