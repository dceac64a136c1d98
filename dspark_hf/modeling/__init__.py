"""The drafter itself: config (``configuration_dspark``), backbone, heads and model (``modeling_dspark``). torch +
transformers only; these files are exactly the remote code a drafter's Hub repo ships for ``trust_remote_code``
(``dspark card`` writes them). Nothing is imported here, so ``limits`` can be read without torch."""
