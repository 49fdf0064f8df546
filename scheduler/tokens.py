"""A request's exact token ids, as the engine will see them, computed in the scheduler.

`TokenService.request_token_ids(tenant, session_id, model, body)` turns a validated chat or
completion body into the ids vLLM feeds its model for it (`scheduler.prompt_render` builds the text
as vLLM does, the served model's own tokenizer tokenizes it, `scheduler.incremental` reuses the
session's previous prompt). It never fails a request: where it has no ids (no tokenizer for the
model, input vLLM would refuse or the scheduler cannot reproduce, a timeout) it returns None, counts
`symphony_token_ids_missing{reason}`, and the caller falls back. `tokenize` and `detokenize` serve
the `/tokenize` and `/detokenize` endpoints and raise `NoTokenIds` instead.

Where the work runs: on one thread of its own, never on the event loop. A 2,000-token first turn
costs ~0.5 ms here (`scheduler.piece_encoder`; ~2 ms through `tokenizers` alone), a 20-turn
conversation's last turn 1.3 ms whole and 0.3 ms incrementally, a 4 MB body a good part of a
second: inline, that would stall every other request as long. The piece encoder's Python holds the
GIL, so the loop and the thread take turns (at most the interpreter's switch interval apart, 5 ms);
`tokenizers`, which the non-ASCII text goes to, releases it. Handing a request over costs the loop
~40-70 µs of CPU (docs/design-notes.md#scheduler-tokenizer).
One thread, because a tokenizer object is not thread-safe and the session cache then needs no lock;
at most `MAX_WAITING` requests wait for it (beyond: "busy"), and each gets `timeout_s` from when it
was asked (beyond: "timeout"; work that already started finishes in the background).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from scheduler.incremental import SessionTokenCache, encode, read_only
from scheduler.metrics import SchedulerMetrics
from scheduler.prompt_render import chat_prompt, completion_prompt
from scheduler.prompts import IdsPrompt, NoTokenIds, TextPrompt, Truncation
from scheduler.tokenizer_load import ModelTokenizer, TokenizerUnavailable, load_model_tokenizer
from symphony.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")
S = TypeVar("S", list[int], np.ndarray)
MAX_WAITING = 64  # requests queued for the tokenizer thread beyond which a request gets no ids at once


class TokenService:
    """The served models' tokenizers (loaded in the background from `dirs`, served name -> directory)
    and the sessions' last prompts."""

    def __init__(
        self,
        dirs: Mapping[str, Path],
        metrics: SchedulerMetrics,
        *,
        cache_sessions: int,
        cache_tokens: int,
        timeout_s: float,
    ) -> None:
        self.dirs = dict(dirs)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._models: dict[str, ModelTokenizer] = {}  # written by the tokenizer thread only
        self._cache = SessionTokenCache(cache_sessions, cache_tokens)  # the tokenizer thread's only
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="symphony-tokenizer")
        self._loading: concurrent.futures.Future[None] | None = None
        self._disabled: set[str] = set()  # models whose tokenizer is not their engines' (tokenizer_check)
        # Requests waiting or running: asked (loop thread) - finished (tokenizer thread) - dropped
        # before they started (loop thread). Each counter has one writer.
        self._asked = self._finished = self._dropped = 0

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start loading the tokenizers on the tokenizer thread; requests get "loading" meanwhile."""
        if self.dirs and self._loading is None:
            self._loading = self._executor.submit(self._load_all)

    async def loaded(self) -> None:
        """Wait until every tokenizer is loaded or has failed to."""
        if self._loading is not None:
            await asyncio.wrap_future(self._loading)

    def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _load_all(self) -> None:
        for name, path in self.dirs.items():
            started = time.perf_counter()
            try:
                self._models[name] = load_model_tokenizer(name, path)
            except TokenizerUnavailable as exc:
                log.warning("no tokenizer: requests get no token ids", model=name, reason=str(exc))
            except Exception as exc:  # never let a bad directory take the scheduler down
                log.warning("no tokenizer: requests get no token ids", model=name, reason=repr(exc))
            else:
                seconds = round(time.perf_counter() - started, 2)
                log.info("tokenizer loaded", model=name, path=str(path), seconds=seconds)

    def disable(self, model: str) -> None:
        """Stop using `model`'s tokenizer: its requests get no ids from now on."""
        self._disabled.add(model)

    def status(self, model: str) -> str:
        """One of "ready", "loading" and "none" (no tokenizer for `model`, or one disabled)."""
        if model in self._disabled:
            return "none"
        if model in self._models:
            return "ready"
        loading = self._loading is not None and not self._loading.done()
        return "loading" if loading and model in self.dirs else "none"

    @property
    def cached_sessions(self) -> int:
        return len(self._cache)

    @property
    def cached_tokens(self) -> int:
        return self._cache.tokens

    # -- the API ------------------------------------------------------------------------------------
    async def request_token_ids(
        self, tenant: str, session_id: str | None, model: str, body: Mapping[str, Any]
    ) -> np.ndarray | None:
        """The token ids vLLM will feed its model for this chat or completion request (a validated
        body, not modified), as a read-only '<u4' array; None when the scheduler has none."""
        try:
            return await self._run(model, self._request_ids, tenant, session_id, model, body)
        except NoTokenIds as exc:
            self._metrics.token_ids_missing.labels(exc.reason).inc()
            log.debug("no token ids", model=model, session=session_id, reason=exc.reason, detail=exc.message)
            return None

    async def tokenize(self, model: str, body: Mapping[str, Any]) -> tuple[list[int], list[str] | None]:
        """`/tokenize`: the ids (and token strings when `return_token_strs`) of a validated body."""
        return await self._run(model, self._tokenize, model, body)

    async def detokenize(self, model: str, ids: list[int]) -> str:
        """`/detokenize`: the text of `ids`."""
        return await self._run(model, self._detokenize, model, ids)

    async def _run(self, model: str, work: Callable[..., T], *args: Any) -> T:
        status = self.status(model)
        if status != "ready":
            raise NoTokenIds(
                "loading" if status == "loading" else "no_tokenizer",
                f"the scheduler's tokenizer for {model!r} is still loading"
                if status == "loading"
                else f"the scheduler has no tokenizer for {model!r} (scheduler.tokenizer, scheduler.tokenizers)",
            )
        if self._asked - self._finished - self._dropped >= MAX_WAITING:
            raise NoTokenIds("busy", f"{MAX_WAITING} requests are waiting for the scheduler's tokenizer")
        self._asked += 1
        try:
            future = self._executor.submit(self._counted, work, *args)
        except RuntimeError:  # shut down
            self._dropped += 1
            raise NoTokenIds("error", "the scheduler's tokenizer is stopped") from None
        future.add_done_callback(self._count_dropped)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self._timeout_s)
        except TimeoutError:
            raise NoTokenIds("timeout", f"tokenizing took over {self._timeout_s:g} s") from None
        finally:
            future.cancel()  # a no-op once it started: then it finishes, its result unused

    def _count_dropped(self, future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled():  # cancelled before it started, from the loop thread
            self._dropped += 1

    def _counted(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return work(*args)
        except NoTokenIds:
            raise
        except Exception as exc:
            log.debug("tokenizer error", error=repr(exc))
            raise NoTokenIds("error", f"the scheduler's tokenizer failed: {exc!r}") from None
        finally:
            self._finished += 1

    # -- on the tokenizer thread ----------------------------------------------------------------------
    def _request_ids(self, tenant: str, session_id: str | None, model: str, body: Mapping[str, Any]) -> np.ndarray:
        started = time.perf_counter()
        tokenizer = self._models[model]
        hf = tokenizer.tokenizer
        prompt = chat_prompt(hf, body) if "messages" in body else completion_prompt(hf, body)
        if isinstance(prompt, IdsPrompt):
            if any(i < 0 for i in prompt.ids):
                raise NoTokenIds("invalid_input", "prompt: token ids must not be negative")
            kept = _truncated(prompt.ids, prompt, tokenizer)  # vLLM checks the vocabulary after cutting
            too_large = next((i for i in kept if i > tokenizer.max_token_id), None)
            if too_large is not None:
                raise NoTokenIds("invalid_input", f"Token id {too_large} is out of vocabulary")
            ids, mode = read_only(kept), "ids"
        else:
            key = (tenant, session_id) if session_id is not None else None
            previous = self._cache.get(key) if key is not None else None
            encoded, mode = encode(
                tokenizer.encode, tokenizer.boundaries, model, prompt.text, prompt.add_special_tokens, previous
            )
            if key is not None:
                self._cache.put(key, encoded)
            ids = _truncated(encoded.ids, prompt, tokenizer)
        self._metrics.tokenize_seconds.labels(mode).observe(time.perf_counter() - started)
        # What vLLM's engine checks before it takes a prompt (vllm/v1/engine/input_processor.py).
        if not len(ids):
            raise NoTokenIds("invalid_input", "The decoder prompt cannot be empty")
        tokenizer.check_ids(ids)
        return ids

    def _tokenize(self, model: str, body: Mapping[str, Any]) -> tuple[list[int], list[str] | None]:
        tokenizer = self._models[model]
        if "messages" in body:
            prompt = chat_prompt(tokenizer.tokenizer, body, tokenize_endpoint=True)
        else:
            prompt = TextPrompt(body["prompt"], body.get("add_special_tokens", True))
        ids = tokenizer.encode(prompt.text, prompt.add_special_tokens)
        strings = tokenizer.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return ids, strings

    def _detokenize(self, model: str, ids: list[int]) -> str:
        text: str = self._models[model].tokenizer.decode(ids)
        return text


def _truncated(ids: S, prompt: TextPrompt | IdsPrompt, tokenizer: ModelTokenizer) -> S:
    """`ids` cut as vLLM cuts them for `truncate_prompt_tokens` (no cut without it)."""
    cut: Truncation | None = prompt.truncation
    if cut is None or cut.keep >= len(ids):
        return ids
    if (
        isinstance(prompt, TextPrompt)
        and not cut.explicit_side
        and prompt.add_special_tokens
        and tokenizer.special_tokens_added
    ):
        # transformers truncates inside the encoding, around the special tokens it adds.
        raise NoTokenIds("unsupported", "truncate_prompt_tokens with special tokens added and no truncation_side")
    if cut.keep == 0:
        return ids[:0]
    return ids[-cut.keep :] if cut.side == "left" else ids[: cut.keep]
