"""Measuring a drafter: timed ``generate`` runs and calibration rounds (``runs``). The metrics themselves (τ,
conditional acceptance, ECE / Brier / AUC) are the pure functions of :mod:`dspark_hf.metrics`."""
