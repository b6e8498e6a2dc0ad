"""Hook factories that create, remove and patch attention sinks."""
