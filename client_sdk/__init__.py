"""Python SDK for Symphony: chat with sessions, typing advisories and agent predecessor hints, and
the admin API; sync and async."""

from client_sdk.client import AdminClient, Advisory, AsyncAdminClient, AsyncSymphonyClient, SymphonyClient

__all__ = ["AdminClient", "Advisory", "AsyncAdminClient", "AsyncSymphonyClient", "SymphonyClient"]
