"""Benchmarks, workload generators and (later) the simulator: `symphony bench ...`."""
