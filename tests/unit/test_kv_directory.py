"""node_manager.kv.directory: the per-(block, layer) page tables behind the tiered store."""

from __future__ import annotations

import numpy as np

from node_manager.kv.directory import NO_COPY, PageDirectory
from node_manager.kv.pages import Priority
from node_manager.kv.ssd_tier import SsdLocation


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_rows_grow_past_the_initial_tables_and_keep_their_pages() -> None:
    directory = PageDirectory(num_layers=3, rows=2)
    rows = [directory.ensure_row(key(i), ("t", f"s{i}"), Priority.HIGH) for i in range(9)]
    assert len(set(rows)) == 9 and len(directory) == 9
    for i, row in enumerate(rows):
        directory.dram[row, i % 3] = 100 + i
    assert directory.ensure_row(key(4)) == rows[4], "a known key must keep its row"
    assert [int(directory.dram[directory.row(key(i)), i % 3]) for i in range(9)] == [100 + i for i in range(9)]
    assert directory.owners[rows[8]] == ("t", "s8") and directory.priority[rows[8]] == Priority.HIGH
    assert directory.rows([key(3), key(99), key(0)]).tolist() == [rows[3], NO_COPY, rows[0]]
    assert directory.pages_held() == 9


def test_a_row_is_released_only_when_no_layer_has_a_copy_or_pending_io() -> None:
    directory = PageDirectory(num_layers=2)
    row = directory.ensure_row(key(1))
    directory.set_ssd(row, 1, SsdLocation(7, 3))
    directory.pins[row, 0] = 1
    assert not directory.release_if_empty(row), "released while layer 1 still has an SSD copy"
    directory.set_ssd(row, 1, None)
    assert not directory.release_if_empty(row), "released while a load pins layer 0"
    directory.pins[row, 0] = 0
    directory.persisting[row, 1] = True
    assert not directory.release_if_empty(row), "released while the write-behind owes it an SSD copy"
    directory.persisting[row, 1] = False
    assert directory.release_if_empty(row)
    assert directory.row(key(1)) is None and len(directory) == 0
    reused = directory.ensure_row(key(2))
    assert reused == row and directory.owners[reused] == ("", "")
    assert not directory.held(reused, 0) and not directory.held(reused, 1)


def test_held_matrix_and_ssd_copies() -> None:
    directory = PageDirectory(num_layers=2)
    a, b = directory.ensure_row(key(1)), directory.ensure_row(key(2))
    directory.set_ssd(a, 1, SsdLocation(5, 0))
    directory.checksum[a, 1] = np.uint64(2**64 - 1)
    directory.hbm[b, 0] = 4
    ids = directory.rows([key(1), key(9), key(2)])
    assert directory.held_matrix(ids, directory.ssd_seq).tolist() == [[False, True], [False, False], [False, False]]
    assert directory.held_matrix(ids, directory.hbm).tolist() == [[False, False], [False, False], [True, False]]
    assert list(directory.ssd_copies()) == [(key(1), 1, SsdLocation(5, 0), 2**64 - 1)]
    assert directory.ssd_location(a, 1) == SsdLocation(5, 0) and directory.ssd_location(b, 1) is None
