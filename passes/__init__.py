"""vgraph's Inductor FX passes (pattern-matcher fusions and the pass manager)."""
