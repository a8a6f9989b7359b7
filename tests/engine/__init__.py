"""Tests for vgraph.engine."""
