"""The allowed values of a drafter's verification settings, in a module that imports nothing: the ``dspark`` command
line checks ``--verify`` and ``--gamma`` with them before torch is imported (``dspark_hf.cli``)."""

VERIFICATION_MODES = ("scheduler", "async", "fixed", "threshold")  # paper §3.2.2 (scheduler, async: §5.2), fixed, threshold
MAX_BLOCK_SIZE = 16  # the largest block size γ a drafter may draft per round
