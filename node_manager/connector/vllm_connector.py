"""Symphony's KV connector for vLLM (v1 connector API), loaded through `kv_connector_module_path`.

vLLM builds one instance per role: the scheduler side (engine-core process) asks the node manager
how much of a request's history its tiers hold and plans each step's loads and saves
(`node_manager.connector.plan`); the worker side (model process) moves the pages
(`node_manager.connector.worker`). Both talk to the node manager over the node-local KV channel,
whose socket path comes in `kv_connector_extra_config["socket"]`. The model fingerprint the node
manager computed for this engine (`symphony.model_identity`) comes there too ("model_fingerprint",
hex) with the page layout it stands for ("page_layout"): the lookup keys histories under it, and
both sides refuse a node manager that stores another model's KV; the worker side also refuses to
attach when vLLM's real cache is not in that layout (another dtype, another attention kernel).

A request names its session through `kv_transfer_params` ({"tenant", "session_id"}, see
`symphony.kv_transfer`), signed by the scheduler (or the node manager's warm-up) under a key the
node manager hands over at hello. Unsigned, forged or expired params keep the request off the
tiers entirely (it neither loads nor saves: vLLM alone), as `"symphony_tiers": false` does (the
`recompute` baseline): a client that calls the engine directly cannot name a tenant's KV.
`"symphony_warmup": true` there marks the node manager's own warm-up of a prefetched session
(`node_manager.engine_warmup`), which must not count as the session's next turn arriving.
Anything that goes wrong on the way (node manager away, pages lost) means recompute, never a
failed request: loads are best effort and run with `kv_load_failure_policy = "recompute"`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from node_manager.connector.kv_client import KVChannelError, NodeKVClient
from node_manager.connector.lookup import HeldHistory, HistoryLookup, OtherModelError
from node_manager.connector.params import RequestParams, read_params
from node_manager.connector.plan import ConnectorPlanner, LoadSpec, SaveSpec, TailSave
from node_manager.connector.warm_order import WarmedBlocks
from node_manager.connector.worker import WorkerSide
from node_manager.kv.ipc_wire import PROMPT_TOKEN_SOURCES, WARMUP_PRIORITY_PARAM
from node_manager.kv.pages import Priority
from symphony.kv_addressing import FINGERPRINT_BYTES, ModelFingerprint
from symphony.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = get_logger(__name__)


@dataclass
class SymphonyConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    tail_saves: list[TailSave] = field(default_factory=list)


class SymphonyConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        socket_path = extra.get("socket")
        if not socket_path:
            raise ValueError("SymphonyConnector needs kv_connector_extra_config.socket (the node manager's KV channel)")
        model = model_from_extra_config(extra)
        self._block_size = vllm_config.cache_config.block_size
        self._planner = ConnectorPlanner(self._block_size)
        self._scheduler_client = NodeKVClient(socket_path) if role == KVConnectorRole.SCHEDULER else None
        self._lookup = HistoryLookup(self._scheduler_client, model) if self._scheduler_client is not None else None
        if self._lookup is not None:
            # Mapped up front, so the first request pays no hello; a node manager not up yet is
            # attached by the first request that finds it.
            with contextlib.suppress(OSError, ValueError, KVChannelError):
                self._lookup.attach()
        self._worker = (
            WorkerSide(
                socket_path,
                float(extra.get("layer_wait_s", 30.0)),
                model,
                str(extra.get("page_layout", "")),
                str(vllm_config.cache_config.cache_dtype),
            )
            if role == KVConnectorRole.WORKER
            else None
        )
        self._channel_down_logged = False
        self._requests_by_id: dict[str, Request] = {}  # live requests (vLLM adds and finishes each once)
        self._prompt_tokens = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)  # not yet reported to the node manager
        self._block_pool: BlockPool | None = None  # vLLM's, bound on the scheduler side
        self._model_name = str(vllm_config.model_config.served_model_name)  # what signed params name
        self._refusals_logged: dict[str, float] = {}  # reason -> time.time() it was last logged
        self._key_asked_at = -1.0  # time.time() of the last hello asked for a refused key
        self._warmed = WarmedBlocks()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a request that loses its hand-off recomputes, nothing waits for delivery

    # ---- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._planner.requests.get(request.request_id)
        if state is None:  # its params are read, and their signature checked, once per request
            params = self._read_params(request)
            state = self._planner.track(request.request_id, params.tenant, params.session, params.warmup, params.tiers)
        if not state.warmup:
            self._warmed.arrived((state.tenant, state.session))  # its warmed blocks, if any, are this request's now
        if state.held_keys is None:
            held = (
                self._match(state.tenant, state.session, request.prompt_token_ids or [], state.warmup)
                if state.tiers
                else None
            )
            state.held_keys, state.held_tail = (held.keys, held.tail_tokens) if held is not None else ((), 0)
        return self._planner.matched(state, num_computed_tokens, request.num_tokens), False

    def _read_params(self, request: Request) -> RequestParams:
        """The request's params as the connector believes them (`connector.params`); a refusal is
        logged at most once a minute per reason. A key refused
        ("forged", or none yet) is asked for again, at most once a second: the node manager may
        have restarted with another."""
        assert self._lookup is not None
        lookup, now = self._lookup, time.time()

        def read() -> RequestParams:
            return read_params(request.kv_transfer_params, request.request_id, self._model_name, lookup.params_key, now)

        params = read()
        if params.refusal in ("no key", "forged") and now - self._key_asked_at >= 1.0:
            self._key_asked_at = now
            with contextlib.suppress(Exception):  # the channel's trouble is _match's to report
                lookup.attach()
                params = read()
        if params.refusal is not None and now - self._refusals_logged.get(params.refusal, -60.0) >= 60.0:
            self._refusals_logged[params.refusal] = now  # once a minute per reason: direct callers send many
            log.warning("request's kv_transfer_params refused; it runs without the KV tiers", reason=params.refusal)
        return params

    def _match(self, tenant: str, session: str, token_ids: list[int], warmup: bool) -> HeldHistory | None:
        assert self._lookup is not None
        try:
            held = self._lookup.match(tenant, session, token_ids, warmup)
        except (OSError, ValueError, KVChannelError) as exc:
            if not self._channel_down_logged:  # one line per outage, not one per request
                if isinstance(exc, OtherModelError):
                    log.error("node manager stores another model's KV; requests recompute", error=str(exc))
                else:
                    log.warning("node manager KV channel unavailable; requests recompute", error=str(exc))
                self._channel_down_logged = True
            return None
        self._channel_down_logged = False
        return held

    def _send_registrations(self) -> None:
        assert self._lookup is not None
        try:
            self._lookup.send_registrations()
        except OSError as exc:
            if not self._channel_down_logged:
                log.warning("node manager KV channel unavailable; requests recompute", error=str(exc))
                self._channel_down_logged = True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        sources = self._planner.allocated(
            request.request_id, blocks.get_block_ids()[0], num_external_tokens, request.num_prompt_tokens
        )
        for source, tokens in (sources or {}).items():
            self._prompt_tokens[source] += tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._send_registrations()  # before the workers load or save anything of these requests
        new = [(r.req_id, r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs]
        cached_reqs = scheduler_output.scheduled_cached_reqs
        cached = [
            (req_id, ids[0] if ids is not None else None, req_id in cached_reqs.resumed_req_ids)
            for req_id, ids in zip(cached_reqs.req_ids, cached_reqs.new_block_ids, strict=True)
        ]
        computed_before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed_before.update(zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens, strict=True))
        computed_after = {
            req_id: computed_before.get(req_id, 0) + count
            for req_id, count in scheduler_output.num_scheduled_tokens.items()
        }
        tokens_of = {req_id: self._requests_tokens(req_id) for req_id in computed_after}
        plan = self._planner.step(new, cached, computed_after, tokens_of)
        if self._block_pool is not None:  # warm-ups that ended last step: their blocks are free now
            self._warmed.refile(self._block_pool.free_block_queue)
        self._report_prompt_tokens()
        return SymphonyConnectorMetadata(plan.loads, plan.saves, plan.tail_saves)

    def _report_prompt_tokens(self) -> None:
        if not any(self._prompt_tokens.values()):
            return
        assert self._scheduler_client is not None
        try:
            self._scheduler_client.report(prompt_tokens=self._prompt_tokens)
        except OSError:
            return  # kept for the next step; the match path logs the outage
        self._prompt_tokens = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)

    def _requests_tokens(self, request_id: str) -> list[int]:
        request = self._requests_by_id.get(request_id)
        return list(request.all_token_ids) if request is not None else []

    def on_new_request(self, request: Request) -> None:
        self._requests_by_id[request.request_id] = request

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._block_pool = gpu_block_pool

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._planner.requests.get(request.request_id)
        if state is not None and state.warmup and self._block_pool is not None:
            self._warmed.finished(
                (state.tenant, state.session),
                _priority(request.kv_transfer_params),
                [self._block_pool.blocks[i] for i in block_ids],
            )
        # Full blocks were copied out within their step; a partial last block is copied in the next
        # step, so vLLM keeps the blocks until the worker reports that copy (`get_finished`).
        saving_tail = self._planner.finished(
            request.request_id, request.num_computed_tokens, request.all_token_ids, block_ids
        )
        self._requests_by_id.pop(request.request_id, None)
        return saving_tail, None

    # ---- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SymphonyConnectorMetadata)
        self._worker.start_loads(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SymphonyConnectorMetadata)
        self._worker.save_layer(metadata.saves, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SymphonyConnectorMetadata)
        self._worker.save_tails(metadata.tail_saves)  # after the forward: off the loads' way
        self._worker.finish_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.saved_tails(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._lookup is not None:
            self._lookup.close()
        if self._scheduler_client is not None:
            self._scheduler_client.close()


def model_from_extra_config(extra: dict[str, Any]) -> ModelFingerprint:
    """The fingerprint the node manager launched this engine for. Raises ValueError when it is
    missing or malformed: an engine that cannot tell its model's KV from another's must not start."""
    text = extra.get("model_fingerprint")
    try:
        model = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        model = b""
    if len(model) != FINGERPRINT_BYTES:
        raise ValueError(
            "SymphonyConnector needs kv_connector_extra_config.model_fingerprint (64 hex digits, "
            f"the node manager's model fingerprint), got {text!r}"
        )
    return ModelFingerprint(model)


def _priority(params: dict[str, Any] | None) -> Priority:
    """A warm-up's priority tier from its kv_transfer_params; NORMAL when absent or not a tier
    (the parameters come with a request: nothing in them may stop the scheduler)."""
    try:
        return Priority(int((params or {}).get(WARMUP_PRIORITY_PARAM, Priority.NORMAL)))
    except (TypeError, ValueError):
        return Priority.NORMAL
