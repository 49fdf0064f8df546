"""The node's tiered KV store: HBM (engine device) / DRAM (shared arena) / SSD (segment files).

Modules, from pure to I/O:
- names and bookkeeping, no I/O, no store lock: `pages` (tiers, page ids, checksums), `eviction`
  (victim order, deferred recency), `directory` (which tier holds which copy of every page),
  `holdings` (which full blocks each tier holds whole, as block events), `segments` (the SSD file
  format), `errors`, `store_config`, `metrics`;
- storage, one kind of tier each, their contracts in `tiers`: `slots` (slot allocator, DRAM arena,
  device pool), `ssd_tier` (segment files, their index and space); and `block_index` (the blocks
  held in every layer, shared with the vLLM connector);
- the store: `store` (`TieredStore`, the front: the lock, the directory, the slot allocators,
  lookups and pins), `sessions` (registered histories and their block keys), `store_front` (the
  front as its parts see it), `ingest` (saves and peer pages into DRAM), `write_behind` (their copies
  on SSD), `loads` and `load_plan` (loads and promotions, and where each page comes from), `loader`,
  `memory_load` and `ssd_load` (moving a load's bytes: the general, DRAM and SSD paths);
- around it: `prefetch` (deadline-ordered moves between tiers), `transfer`, `page_stream` and
  `puller` (node to node), `block_events` (the node's numbered log of block events, its own small
  lock) and `block_watch` (its WatchBlocks stream: snapshot, replay, live, heartbeats), `service`
  (gRPC), `ipc_server` and `ipc_wire` (the vLLM connector's node-local channel).
"""
