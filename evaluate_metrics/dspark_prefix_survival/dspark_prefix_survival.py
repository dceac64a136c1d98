"""ECE, Brier score and ROC-AUC of DSpark's prefix survival as an `evaluate` metric:
`evaluate.load("evaluate_metrics/dspark_prefix_survival")`.

The maths is :func:`dspark_hf.metrics.prefix_survival_metrics` (also behind `SequentialTemperatureScaling.report`
and the bench's calibration tables).
"""

import datasets
import evaluate
import torch

from dspark_hf.metrics import prefix_survival_metrics

_DESCRIPTION = """Calibration (ECE with equal-width bins, Brier score) and discrimination (ROC-AUC) of the prefix
survival probability a_k = c_1 · ... · c_k against the outcome 1[n >= k], per draft position k (paper §3.2.1, §4).
Rounds must have verified all γ drafts, so every outcome is observed."""

_KWARGS_DESCRIPTION = """
Args:
    confidences (`list` of `list` of `float`): per round the γ conditional confidences c_1..c_γ in [0, 1]
        (raw, or calibrated with `drafter.calibration.apply` to judge the calibration).
    accepted (`list` of `int`): draft tokens accepted per round, in 0..γ.
    n_bins (`int`, default 15): ECE bins.
Returns:
    ece, brier (`float`): means over the γ positions; roc_auc (`float` or `None`): mean over positions where both
    outcomes occur; n_rounds (`int`); positions (`list` of `dict`): per position k `position`, `survival_rate`,
    `ece`, `brier`, `roc_auc`.
Examples:
    >>> metric = evaluate.load("evaluate_metrics/dspark_prefix_survival")
    >>> round(metric.compute(confidences=[[0.9, 0.5], [0.2, 0.5]], accepted=[2, 0])["brier"], 6)
    0.090625
"""

_CITATION = """DSpark: confidence-scheduled block drafting for speculative decoding (the paper this repository implements)."""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class DSparkPrefixSurvival(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
                                   features=datasets.Features({"confidences": datasets.Sequence(datasets.Value("float64")),
                                                               "accepted": datasets.Value("int64")}))

    def _compute(self, confidences, accepted, n_bins=15):
        return prefix_survival_metrics(torch.tensor(confidences, dtype=torch.float64), torch.tensor(accepted), n_bins)
