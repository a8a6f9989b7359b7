"""Model runner, sampler and forward context: what happens to one scheduled batch on the device."""
