"""Per-node manager: supervises one vLLM engine and answers the scheduler over gRPC."""
