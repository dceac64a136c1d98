"""Position-wise conditional acceptance as an `evaluate` metric:
`evaluate.load("evaluate_metrics/dspark_conditional_acceptance")`.

The maths is :func:`dspark_hf.metrics.conditional_acceptance` (what the bench reports, paper Fig. 2).
"""

import datasets
import evaluate

from dspark_hf.metrics import conditional_acceptance

_DESCRIPTION = """Conditional acceptance of draft position k: P(n >= k | n >= k - 1) for k = 1..γ, over rounds that
verified all γ drafts (n = draft tokens accepted in the round). Paper Fig. 2."""

_KWARGS_DESCRIPTION = """
Args:
    accepted (`list` of `int`): draft tokens accepted per round, each in 0..gamma, from rounds that verified
        all gamma drafts (e.g. `dspark_hf.decoding.stats.full_rounds(stats_list, gamma)[0]`).
    gamma (`int`): drafts per round γ.
Returns:
    conditional_acceptance (`list` of `float` or `None`): γ rates; `None` where no round reached position k.
Examples:
    >>> metric = evaluate.load("evaluate_metrics/dspark_conditional_acceptance")
    >>> metric.compute(accepted=[0, 2, 2, 1], gamma=2)
    {'conditional_acceptance': [0.75, 0.6666666666666666]}
"""

_CITATION = """DSpark: confidence-scheduled block drafting for speculative decoding (the paper this repository implements)."""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DSparkConditionalAcceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
                                   features=datasets.Features({"accepted": datasets.Value("int64")}))

    def _compute(self, accepted, gamma):
        if int(gamma) < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}.")
        return {"conditional_acceptance": conditional_acceptance(accepted, int(gamma))}
