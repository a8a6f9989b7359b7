"""Requests, the paged KV block pool with prefix caching, and the scheduler."""
