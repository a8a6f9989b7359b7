"""Gives every ``ModelRunner`` of a perf server's processes an emulated device.

Python imports ``sitecustomize`` at startup from the first folder on its path that has one, so a
``vgraph serve`` started with this folder first on ``PYTHONPATH`` and ``VGRAPH_PERF_EMULATED_DEVICE_MS``
set (``emulated_server_env``) loads it in the server process and in the engine-core process it
spawns. Why: on a CPU the forward computes on the engine's thread, so a served run measures the
CPU's compute; with each step also occupying an emulated device for a fixed time (released
without the GIL, as a GPU's queue lets the host go on), a served run on this machine shows what
the HTTP layer, the client and the engine loop cost next to a device that sets the pace, as on a
GPU. Perf only: nothing in vgraph reads the variable.
"""
import os

_MS = os.environ.get("VGRAPH_PERF_EMULATED_DEVICE_MS")
if _MS:
    from vgraph.testing.emulated_device import emulated_device
    from vgraph.worker.runner import ModelRunner

    _init = ModelRunner.__init__
    _ENTERED = []  # the entered context managers: one collected would exit, restoring the runner

    def _init_on_emulated_device(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        device = emulated_device(self, float(_MS) / 1e3)
        device.__enter__()  # for the runner's lifetime
        _ENTERED.append(device)

    ModelRunner.__init__ = _init_on_emulated_device
