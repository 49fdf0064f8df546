"""`symphony bench faults`: scenarios that break a live private cluster on purpose (crashes,
attacks) while greedy chats run through it, and the checker that judges what the chats and the
cluster show afterwards (`eval.faults.checker`)."""
