"""The bundled agentshare server: shared prefill, per-agent decode, KV block pool."""
