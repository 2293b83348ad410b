"""The tiers: the local tier (committed steps, crash recovery), the memory tier, the remote
tier's commit protocol, the node commit handshake, listings across tiers, retention passes and
the upload queue. All their I/O goes through :mod:`dcp_tiered.backends`."""
