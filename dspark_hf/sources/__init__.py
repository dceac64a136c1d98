"""Data sources (issue #27): ShareGPT V3 records and their fixed split (:mod:`~dspark_hf.sources.sharegpt`), their
chat turns (:mod:`~dspark_hf.sources.conversations`), prompt categories (:mod:`~dspark_hf.sources.categories`),
HumanEval (:mod:`~dspark_hf.sources.humaneval`) and the chat-formatted prompt queue
(:mod:`~dspark_hf.sources.prompt_queue`). Training, STS calibration and the bench read them;
nothing here knows of those (``tests/test_layering.py``).
"""
