"""What prefill and decode instances share: settings, the engine runtime, pool transfers,
registration with the router, and their metrics."""
