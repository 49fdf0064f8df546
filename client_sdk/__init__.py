"""Python SDK for Symphony: chat with sessions and typing advisories, sync and async."""

from client_sdk.client import Advisory, AsyncSymphonyClient, SymphonyClient

__all__ = ["Advisory", "AsyncSymphonyClient", "SymphonyClient"]
