"""The engine's KV event subscriber under the node's engine supervision: it follows the engine from
start to stop, and the engine's cache is reported gone ("cleared") whenever the engine process goes.

The engine is a stand-in process (tests/integration/fake_child.py) and its events come from vLLM's
own publisher in this process, bound where the engine core would bind it; the real engine's events
are checked in tests/e2e/test_engine_cache_events.py."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events as vllm_events

from node_manager.engine import Engine, EngineLaunch
from node_manager.engine_event_keys import CLEARED, STORED, TenantSalts
from node_manager.engine_events import EngineEventSubscriber, kv_events_config
from symphony.config import EngineConfig
from symphony.kv_addressing import BlockKey, chain_block_keys
from symphony.process import ProcessState
from symphony.tenancy import engine_cache_salt
from tests.helpers import TEST_MODEL, async_wait_until, free_port

FAKE_CHILD = Path(__file__).with_name("fake_child.py")
BS = 32


async def test_the_subscriber_follows_the_engine_and_reports_its_cache_gone_when_it_goes(tmp_path: Path) -> None:
    calls: list[tuple[str, list[BlockKey]]] = []  # appended on the subscriber's thread, read here

    def emit(kind: str, keys: Sequence[BlockKey]) -> None:
        calls.append((kind, list(keys)))

    port = free_port()
    endpoint = f"ipc://{tmp_path / 'engine.events'}"
    launch = EngineLaunch(
        [sys.executable, str(FAKE_CHILD), "--port", str(port)], dict(os.environ), f"http://127.0.0.1:{port}"
    )
    config = EngineConfig(restart_backoff_s=0.05, restart_backoff_max_s=0.1)
    engine = Engine("node-7-engine", launch, config, tmp_path / "engine.log", scrape_interval_s=0.05)
    subscriber = EngineEventSubscriber(
        endpoint, TEST_MODEL, BS, TenantSalts(), emit, max_blocks=64, poll_s=0.02, name="test-kv-events"
    )
    engine.follow_block_events(subscriber)
    engine.start()
    # What the engine core would run: vLLM's publisher, bound at the endpoint the engine was given.
    publisher = vllm_events.EventPublisherFactory.create(KVEventsConfig(**kv_events_config(endpoint)), 0)
    try:
        assert subscriber.running
        await async_wait_until(lambda: engine.process.state is ProcessState.READY, 20, "the engine ready")
        token_ids = list(range(BS))
        key = chain_block_keys(TEST_MODEL, "default", token_ids, BS).block_keys[0]
        stored = vllm_events.BlockStored(
            block_hashes=[b"h" * 32],
            parent_block_hash=None,
            token_ids=token_ids,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[(engine_cache_salt("default"),)],
        )

        def publish_and_check() -> bool:  # PUB drops what it sends before the SUB's connection is up
            publisher.publish(vllm_events.KVEventBatch(ts=0.0, events=[stored]))
            return (STORED, [key]) in calls

        await async_wait_until(publish_and_check, 10, "the engine's block as a block key", interval_s=0.05)
        emitted = len(calls)

        await engine.process.kill_for_test(signal.SIGKILL)  # the supervisor restarts it
        await async_wait_until(lambda: calls[emitted:][:1] == [(CLEARED, [])], 10, "the crashed engine's cache gone")
        await async_wait_until(lambda: engine.process.restarts == 1, 20, "the engine restarted")
        assert subscriber.running  # one subscriber for every run of the engine
    finally:
        publisher.shutdown()
        emitted = len(calls)
        await engine.stop()
    assert calls[emitted:] == [(CLEARED, [])]  # the stopped engine's cache is gone too
    assert not subscriber.running
    assert not await asyncio.to_thread(Path(endpoint.removeprefix("ipc://")).exists)  # the socket file
