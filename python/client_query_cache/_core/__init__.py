"""Private core shared by the sync and async facades: classification, keys,
configuration, errors, snapshots and the engine around the native cache."""
