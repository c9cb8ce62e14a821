"""Runnable examples of client-query-cache (see examples/README.md)."""
