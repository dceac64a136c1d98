"""The ``dspark`` command line: one thin module per command, assembled by :mod:`dspark_hf.cli.main`
(``python -m dspark_hf.cli``)."""
