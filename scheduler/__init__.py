"""Cluster scheduler: OpenAI-compatible HTTP API, advisories, routing policies, node status polling."""
