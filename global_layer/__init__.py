"""The global layer of a multi-region cluster: an entry in every region that sends each request to a
region (global_layer.policies), whose scheduler places it on a node."""
