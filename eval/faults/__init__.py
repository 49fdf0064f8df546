"""`symphony bench faults`: scenarios that break a live private cluster on purpose (crashes,
network faults, disk faults, attacks, overload) while greedy chats run through it, and the checker that judges
what the chats and the cluster show afterwards (`eval.faults.checker`)."""

SCENARIOS = ("crashes", "network", "disk", "attacks", "overload")
# SIGKILL, or SIGSTOP then SIGCONT, of each kind of process (eval.faults.crashes).
CRASH_KINDS = ("engine_kill", "node_kill", "node_stop", "replica_kill", "etcd_kill", "etcd_stop")
# A node's link partitioned, blackholed, or slowed, then healed (eval.faults.network).
LINK_KINDS = ("link_partition", "link_blackhole", "link_latency")
# A node's SSD segments damaged, its disk filled, its dtype changed (eval.faults.disk).
DISK_KINDS = ("segment_corrupt", "disk_full", "dtype_change")
