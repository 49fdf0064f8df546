"""The node's tiered KV store: HBM (engine device) / DRAM (shared arena) / SSD (directory).

Layers, from pure to I/O: `pages` (names and checksums), `eviction` (pure victim ordering),
`slots`/`dram_arena`/`device_pool` (fixed-size page storage), `segments` (the SSD file format),
`ssd_tier` (files, index, write-behind), `store` (bookkeeping that ties the tiers together and the
layer-wise load/save API), `prefetch` (deadline-ordered moves between tiers), `transfer` (node to
node), `service` (gRPC).
"""
