"""What decoding runs on (issue #27): target loading (``targets``), the machine description (``machine``), CPU
kernels (``kernels``: prepacked linears; ``attention``: grouped-query SDPA; ``ragged``: many requests in one
forward), kernel choices timed on the machine (``tuning``), the KV cache (``kv_cache``), the SPS curve (``sps``) and its profile (``profiling``). Nothing here knows of
drafting (:mod:`dspark_hf.decoding` sits above; ``tests/test_layering.py``)."""
