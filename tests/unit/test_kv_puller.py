"""PeerPuller's channel handling, against a real gRPC server in this process."""

from __future__ import annotations

import grpc
import pytest

from node_manager.kv.puller import PeerPuller
from tests.helpers import free_port
from tests.unit.kv_store_support import MakeStore


async def test_connect_opens_the_channel_a_pull_then_reuses(make_store: MakeStore) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    puller = PeerPuller(make_store(), timeout_s=5)
    try:
        address = f"127.0.0.1:{port}"
        await puller.connect(address)
        channel = puller._channels[address]
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        puller._stub(address)
        assert puller._channels[address] is channel  # the pull's stub rides the warm channel
    finally:
        await puller.close()
        await server.stop(None)


async def test_connect_to_a_dead_peer_times_out(make_store: MakeStore) -> None:
    puller = PeerPuller(make_store(), timeout_s=5)
    try:
        with pytest.raises(TimeoutError):
            await puller.connect(f"127.0.0.1:{free_port()}", timeout_s=0.3)
    finally:
        await puller.close()
