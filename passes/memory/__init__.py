"""Memory beyond sharding: selective activation recompute, and offload (optimizer-state records
and stage-3 shards placed on device, host or NVMe; shards fetched before their gather; gradient
shards handed off as their reduction ends)."""
