"""Tests for vgraph.worker."""
