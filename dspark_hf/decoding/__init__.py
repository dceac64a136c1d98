"""Drafting inside ``generate`` (the hot path): the candidate generator, verification policies, the prefix
scheduler, STS calibration, prompt lookup, stopping, per-call statistics, the batched and concurrent loops and the
transformers routing. What they run on (the target, the machine, kernels, the KV cache, the SPS curve) is
:mod:`dspark_hf.runtime`."""
