"""τ of DSpark speculative decoding as an `evaluate` metric: `evaluate.load("evaluate_metrics/dspark_tau")`.

The maths is :func:`dspark_hf.metrics.tau` (the same function the bench and `GenerationStats.tau` use).
"""

import datasets
import evaluate

from dspark_hf.metrics import tau

_DESCRIPTION = """τ: mean tokens produced per speculative round, the bonus / correction token included
(paper Table 1): mean(n + 1) over rounds, where n = draft tokens the target accepted in the round."""

_KWARGS_DESCRIPTION = """
Args:
    accepted (`list` of `int`): draft tokens accepted per round (bonus excluded), each >= 0; e.g.
        `[r.accepted for r in drafter.last_stats.rounds]`.
Returns:
    tau (`float` or `None`): mean(n + 1); `None` for no rounds.
Examples:
    >>> metric = evaluate.load("evaluate_metrics/dspark_tau")
    >>> metric.compute(accepted=[0, 3, 7])
    {'tau': 4.333333333333333}
"""

_CITATION = """DSpark: confidence-scheduled block drafting for speculative decoding (the paper this repository implements)."""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DSparkTau(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
                                   features=datasets.Features({"accepted": datasets.Value("int64")}))

    def _compute(self, accepted):
        return {"tau": tau(accepted)}
