"""Drafting inside ``generate``: the candidate generator, verification policies, the prefix scheduler, STS
calibration, SPS profiling, CPU kernels, prompt lookup, target loading and the transformers routing."""
