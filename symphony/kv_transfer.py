"""The `kv_transfer_params` a request carries to Symphony's KV connector inside vLLM: the contract
between whoever sends requests to an engine (the scheduler, the node manager's warm-ups, a client
talking to an engine directly) and the connector."""

TENANT_PARAM = "tenant"  # whose KV: keys are namespaced by tenant, so tenants never share any
SESSION_PARAM = "session_id"  # which session's history the request continues
TIERS_PARAM = "symphony_tiers"  # false: neither load from nor save to Symphony's tiers (vLLM alone)
