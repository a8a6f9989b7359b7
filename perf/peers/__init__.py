"""Other CPU inference engines, for the ``cpu-peers`` suite: their virtual environments, model
conversions (``envs.py``) and the runner each engine's process executes (``runner.py``)."""
