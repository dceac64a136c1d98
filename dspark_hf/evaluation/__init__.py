"""Measuring a drafter: timed ``generate`` runs and calibration rounds (``runs``) and the typed result of
``dspark bench`` (``bench_result``, on the JSON records of ``records``), which the bench report and the model card
both read. The metrics themselves (τ, conditional acceptance, ECE / Brier / AUC) are the pure functions of
:mod:`dspark_hf.metrics`."""
