"""The compiler: Dynamo capture, the piecewise split at attention, Inductor compilation with
vgraph's passes, and the on-disk compile cache."""
