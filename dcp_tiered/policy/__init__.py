"""Policy and formats: names on disk, the manifest, checksums, retention, cadence, admission and
the memory slot format. Pure: no I/O, and no import of a tier, a backend or an entry point."""
