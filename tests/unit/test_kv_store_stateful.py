"""The tiered store driven by hypothesis' stateful testing: random sequences of saves, loads,
flushes, demotions, restarts (DRAM lost, SSD kept) and bit flips in SSD segments, against a model
of what was saved. What it holds the store to: a load delivers each page either with bytes saved
under its key, or as failed (evicted, damaged), never other bytes; and once flushed, nothing stays
pinned. A key is the session's tokens up to the block (content-addressed): a session saved again
with other bytes, as a model whose numerics wobble would, may keep either copy."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from uuid import uuid4

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from node_manager.kv.pages import Tier
from node_manager.kv.store import TieredStore
from node_manager.kv.store_config import StoreConfig
from tests.helpers import TEST_MODEL
from tests.unit.kv_store_support import (
    GEOMETRY,
    LAYERS,
    TIMEOUT,
    flip_bits,
    load_rows,
    page_data,
    segment_files,
    tokens,
)

SESSIONS = ("a", "b", "c", "d")
SECRET = b"the stateful test's cluster secret"


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="symphony-stateful-"))
        self.store: TieredStore | None = None
        # session -> its blocks as last saved; (session, block, layer) -> every page saved under
        # that key (a load may deliver any of them, or fail); the sessions flushed to SSD.
        self.saved: dict[str, int] = {}
        self.pages: dict[tuple[str, int, int], set[bytes]] = {}
        self.flushed: set[str] = set()

    def _open(self) -> TieredStore:
        config = StoreConfig(
            hbm_bytes=8 * GEOMETRY.page_bytes,
            dram_bytes=24 * GEOMETRY.page_bytes,
            ssd_bytes=64 << 10,  # a few dozen small segments: evictions happen
            ssd_dir=self.directory,
            arena_name=f"symphony-stateful-{uuid4().hex[:8]}",
            model=TEST_MODEL,
            segment_max_bytes=16 << 10,
            page_secret=SECRET,
        )
        return TieredStore(GEOMETRY, config)

    @initialize()
    def start(self) -> None:
        self.store = self._open()

    def _tokens(self, session: str, blocks: int) -> list[int]:
        return tokens(blocks, base=1000 + 1000 * SESSIONS.index(session))

    @rule(session=st.sampled_from(SESSIONS), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
    def save(self, session: str, blocks: int, seed: int) -> None:
        assert self.store is not None
        data = page_data(blocks, seed)
        self.store.sessions.put("acme", session, self._tokens(session, blocks))
        for layer in range(LAYERS):
            self.store.ingest.save_layer("acme", session, layer, 0, data[layer]).result(TIMEOUT)
        self.saved[session] = max(blocks, self.saved.get(session, 0))
        for layer in range(LAYERS):
            for block in range(blocks):
                self.pages.setdefault((session, block, layer), set()).add(data[layer][block].numpy().tobytes())
        self.flushed.discard(session)

    @rule()
    def flush(self) -> None:
        assert self.store is not None
        assert self.store.write_behind.flush(TIMEOUT)
        assert self.store.pinned_pages() == 0  # loads released theirs; saves' are written behind
        self.flushed |= set(self.saved)

    @rule(session=st.sampled_from(SESSIONS), tier=st.sampled_from([Tier.HBM, Tier.DRAM]))
    def demote(self, session: str, tier: Tier) -> None:
        assert self.store is not None
        if session in self.saved:  # registered again: a restart forgets sessions, not their pages
            self.store.sessions.put("acme", session, self._tokens(session, self.saved[session]))
            self.store.demote("acme", session, tier)  # never loses KV: only copies SSD also holds

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        assert self.store is not None
        session = data.draw(st.sampled_from(sorted(self.saved)))
        blocks = self.saved[session]
        self.store.sessions.put("acme", session, self._tokens(session, blocks))
        tensors, results = load_rows(self.store, session, blocks)
        checked = sum(blocks - len(result.failed) for result in results)
        event("a load delivered pages" if checked else "a load delivered none")  # --hypothesis-show-statistics
        for result in results:
            for block in range(blocks):
                if block in result.failed:
                    continue  # evicted, damaged or never flushed before a restart: failed, not wrong
                got = tensors[result.layer][block].numpy().tobytes()
                assert got in self.pages[(session, block, result.layer)], (
                    f"session {session} layer {result.layer} block {block}: bytes never saved under its key"
                )

    @rule()
    def restart(self) -> None:
        """A node manager stopped and started again: DRAM and HBM gone, SSD rebuilt (what was not
        flushed may be gone too: close() flushes, but a kill would not)."""
        assert self.store is not None
        self.store.close(flush_timeout=TIMEOUT)
        self.store = self._open()

    @precondition(lambda self: bool(self.flushed))
    @rule(which=st.integers(0, 1 << 16), where=st.integers(0, 1 << 16), mask=st.integers(1, 255))
    def flip_a_bit_on_disk(self, which: int, where: int, mask: int) -> None:
        """Damage a byte of some segment's pages. Which file and where are fractions of what is on
        disk now: the write-behind's timing decides the files, not the drawn values."""
        files = segment_files(self.directory)
        if not files:
            return
        path = files[which % len(files)]
        size = path.stat().st_size
        if size > 4096:  # in the pages, past the 4 KiB header
            flip_bits(path, 4096 + where % (size - 4096), mask)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close(flush_timeout=TIMEOUT)
        shutil.rmtree(self.directory, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_the_store_never_delivers_other_bytes_than_saved = StoreMachine.TestCase
