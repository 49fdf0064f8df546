"""The settings `bench sim --scenario regions` runs with unless told otherwise
(eval.sim.regions_scenario explains them): constants only, so the command line can show them
without importing the simulator."""

REGIONS = ("us-east", "eu-west", "ap-south")
POLICIES = ("nearest", "skywalker", "gorgo", "gorgo_no_queue", "symphony")
EU_TENANT = "eu-only"
SLO_MS = 500.0
# The SLO holds in every window of the day for every client region: a fleet is sized for its peak
# hour. (A p95 over the whole day lets one region's peak miss it while the other regions' quiet
# hours make up the count; the scenario reports that reading too, `replicas_for_slo_whole_day`.)
WINDOW_S = 10.0  # a 36th of the default simulated day
REFERENCE_REPLICAS = 8  # the scale: 3 regions x 8 replicas
MAX_REPLICAS = 20  # nearest needs 16 on the default day (docs/benchmarks.md, run 4)
REPLICAS_TARGET = 0.75  # symphony's replicas over nearest's (SkyWalker: 9 / 12)
HACKING_FACTOR = 1.5  # gorgo_no_queue's p95 over gorgo's that counts as shown
# The load: sized so that 8 replicas per region fall short at the hot region's peak and suffice for
# the day's mean (docs/benchmarks.md, "bench sim --scenario regions").
ARRIVALS_PER_MIN = 4500.0  # per region, on average over the day
AMPLITUDE = 0.8
# Simulated seconds (--duration): about three conversations long, so that each region's load follows
# its own day and the three peaks pass each other (a 120-second day, runs 1-3 in docs/benchmarks.md,
# is about one conversation long: the load piles up to its end and the peaks overlap there).
DAY_S = 360.0
TIME_SCALE = 0.1  # of human reading and typing times: conversations short against the day
