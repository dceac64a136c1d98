"""Checks of the target a drafter binds to: it shares the target's lm_head rows, so they must be a float
``[V, d]`` tensor, and verification is lossless only when a token's logits do not depend on the other tokens of
the forward (paper §2.2, Appendix A)."""

from __future__ import annotations

import torch


def lm_head_weight(head) -> torch.Tensor:
    """The ``[V, d]`` floating-point weight of a target's lm_head, which the drafter shares (paper §2.2).

    Raises:
        TypeError: ``head`` has no such tensor (a quantized module exposes ``weight`` as a method or an
            integer tensor); the message says what is supported.
    """
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise TypeError(
            f"DSpark reads the target's lm_head rows directly, so the lm_head must be a module with a floating-point "
            f"[vocab, hidden] `weight` tensor (nn.Linear in float32/bfloat16/float16); got {type(head).__module__}."
            f"{type(head).__name__}. Use an unquantized (float32/bfloat16/float16) target."
        )
    return weight


def check_row_independent(target):
    """Refuse targets whose token logits depend on the OTHER tokens of a forward (verification would not be lossless).

    ``torch.ao`` dynamic quantization computes one activation scale per forward over all its tokens, so the
    verification forward's logits at a position depend on the values of the drafts after it, and acceptance
    would depend on draft values (paper Appendix A). Float kernels (any batch size) are row-independent.

    Raises:
        TypeError: a dynamically quantized module is found; the message names what is supported.
    """
    dynamic = sorted({type(m).__name__ for m in target.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")})
    if dynamic:
        raise TypeError(
            f"The target has dynamically quantized modules ({', '.join(dynamic)}: torch.ao quantize_dynamic). Their "
            "activation scale is computed over all tokens of a forward, so a verified token's logits would depend on "
            "the drafts verified with it and speculative decoding would not be lossless. Use a float32/bfloat16/float16 "
            "target, or a weight-only quantization whose tokens are computed independently."
        )
