"""The tuner: Optuna studies over the engine's knobs against SLOs, recorded in the results database.

space.py (search space from the knob registry) · slo.py (SLO specs, attainment, goodput, capacity) ·
metrics.py (objectives) · baselines.py (peer-style configs enqueued first) · feasibility.py (memory) ·
objective.py (one trial) · watch.py (cutting hopeless trials short) · record.py (our tables) ·
study.py (storage, resume, heartbeat) · export.py (ranking, reports, exported configs) · cli.py.
"""
