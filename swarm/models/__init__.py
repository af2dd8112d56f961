"""Models cut into pipeline stages: ResNet-18 (CIFAR), GPT-2, small digits models, user models.

Every builder builds the whole model under the caller's seed and then cuts it, so the number of
stages never changes the weights and the composed stages compute what the unsplit model does.
"""

from swarm.models.base import (
    StagedModel,
    TiedPair,
    causal_lm_loss,
    causal_lm_metrics,
    classification_loss,
    classification_metrics,
    plan_cuts,
    summarize,
)
from swarm.models.registry import MODELS, build_model, model_options

__all__ = [
    "MODELS",
    "StagedModel",
    "TiedPair",
    "build_model",
    "causal_lm_loss",
    "causal_lm_metrics",
    "classification_loss",
    "classification_metrics",
    "model_options",
    "plan_cuts",
    "summarize",
]
