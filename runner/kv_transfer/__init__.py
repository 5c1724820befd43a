"""KV connectors, worker side: the host offload pool, pulls from a peer, fault injection."""
