"""The top tier's last step: put a session's history into the engine's own prefix cache.

A TIER_HBM prefetch first brings the session's pages into the node's fast tiers; then the warmer
sends the engine one request made of the history, `max_tokens=1`, under the cache salt the next
turn will carry. The engine's connector loads the history from the node's tiers layer by layer
(only the tail past the last full block is computed), and vLLM keeps the blocks in its prefix
cache when the request ends. The next turn then starts as a plain local prefix-cache hit, with no
load on its critical path.

Why a request rather than blocks staged by hand in vLLM's block pool: block hashing, salts and
prefix-cache insertion stay vLLM's own work through its public API, where hand staging means
private hash-table surgery that each vLLM release may break.

Memory: once the warm-up ends, its blocks are cached but free (no request holds them). vLLM counts
them as free, takes them back (least recently used first) whenever a running request or an
admission needs blocks, and never preempts or refuses a request to keep them. The warm-up itself
is a request, though, so it is sent only while no request waits and the engine's KV usage leaves
room (`max_kv_usage`): it never delays a real one.
"""

from __future__ import annotations

import time
from typing import Protocol

import httpx

from node_manager.engine_metrics import EngineLoad
from node_manager.kv.ipc_wire import WARMUP_PARAM, WARMUP_PRIORITY_PARAM
from node_manager.kv.metrics import KVMetrics
from node_manager.kv.pages import Priority
from node_manager.kv.prefetch import WarmOutcome
from symphony.kv_transfer import SESSION_PARAM, TENANT_PARAM, sign_params
from symphony.logs import get_logger
from symphony.rpc import node_pb2

log = get_logger(__name__)


class EngineView(Protocol):
    """What the warmer reads of the node's engine (`node_manager.engine.Engine`)."""

    url: str
    headers: dict[str, str]  # what every call to it sends (its key)

    @property
    def state(self) -> int: ...  # node_pb2.EngineState

    @property
    def load(self) -> EngineLoad | None: ...


class EngineWarmer:
    def __init__(
        self,
        engine: EngineView,
        served_model: str,
        metrics: KVMetrics,
        *,
        max_kv_usage: float,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        params_key: bytes = b"",
    ) -> None:
        self._engine = engine
        self._params_key = params_key  # signs the warm-ups' kv_transfer_params, as the scheduler signs its own
        self._model = served_model
        self._metrics = metrics
        self._max_kv_usage = max_kv_usage
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), transport=transport, headers=engine.headers)

    def busy(self) -> str:
        """Why a warm-up must not be sent now ('' when it may)."""
        if self._max_kv_usage <= 0:
            return "engine warm-ups are off (kv.engine_warmup_max_kv_usage = 0)"
        if self._engine.state != node_pb2.ENGINE_STATE_READY:
            return "the engine is not ready"
        load = self._engine.load
        if load is None:
            return "the engine's load is not known yet"
        if load.waiting:
            return f"{load.waiting} requests are waiting for the engine"
        if load.kv_usage >= self._max_kv_usage:
            return f"the engine's KV cache is {load.kv_usage:.0%} used"
        return ""

    async def warm(
        self, tenant: str, session_id: str, token_ids: list[int], salt: str, priority: Priority = Priority.NORMAL
    ) -> WarmOutcome:
        """Have the engine take the history into its prefix cache; what it took, or why it did not."""
        reason = self.busy()
        if reason:
            self._metrics.engine_warmups.labels("skipped").inc()
            return WarmOutcome(0, reason)
        # vLLM computes at least a prompt's last token, so a prompt of whole blocks would leave its
        # last block uncached; one token more (repeating the last: any id works, it only lands in an
        # uncached partial block, and a warm-up saves nothing) keeps every block.
        body: dict[str, object] = {
            "model": self._model,
            "prompt": [*token_ids, *token_ids[-1:]],
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": sign_params(
                {
                    TENANT_PARAM: tenant,
                    SESSION_PARAM: session_id,
                    WARMUP_PARAM: True,
                    WARMUP_PRIORITY_PARAM: int(priority),
                },
                self._model,
                self._params_key,
                time.time(),
            ),
        }
        if salt:
            body["cache_salt"] = salt
        started = time.monotonic()
        try:
            response = await self._client.post(self._engine.url + "/v1/completions", json=body)
            response.raise_for_status()
            details = (response.json().get("usage") or {}).get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            self._metrics.engine_warmups.labels("failed").inc()
            log.warning("engine warm-up failed", session=session_id, error=str(exc)[:300])
            return WarmOutcome(0, f"the warm-up request failed: {str(exc)[:300]}")
        self._metrics.engine_warmups.labels("cached").inc()
        self._metrics.engine_warmup_tokens.inc(cached)
        log.debug(
            "engine warm-up",
            session=session_id,
            tokens=len(token_ids),
            cached=cached,
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        return WarmOutcome(cached)

    async def aclose(self) -> None:
        await self._client.aclose()
