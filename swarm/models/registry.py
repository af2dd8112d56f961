"""Model names -> builders, with options checked against each builder's signature."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from swarm.config.options import accepted_options, reject_unknown
from swarm.models.base import StageCountError, StagedModel
from swarm.models.causal_lm import build_transformers, vocab_size
from swarm.models.custom import build_custom
from swarm.models.digits import build_digits_cnn, build_digits_mlp
from swarm.models.gpt2 import build_gpt2, make_config
from swarm.models.relay import build_relay
from swarm.models.resnet import build_resnet18

MODELS: dict[str, Callable[..., StagedModel]] = {
    "resnet18": build_resnet18,
    "gpt2": build_gpt2,
    "digits_cnn": build_digits_cnn,
    "digits_mlp": build_digits_mlp,
    "relay": build_relay,
    "transformers": build_transformers,
}

# what building a model imports beyond torch, the first time (seconds of CPU: a lab's spawner,
# swarm.lab.spawn, imports it once for every peer it starts)
LIBRARIES: dict[str, tuple[str, ...]] = {
    "gpt2": ("transformers.models.gpt2.modeling_gpt2",),
    "transformers": ("transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto", "peft"),
}


def model_libraries(name: str) -> tuple[str, ...]:
    """The modules building `name` imports (none known for a custom model)."""
    return LIBRARIES.get(name, ())


def model_options(name: str) -> list[str]:
    """The options a built-in model accepts."""
    return accepted_options(MODELS[name], skip=("num_stages",))


def build_model(name: str, num_stages: int, **options) -> StagedModel:
    """Build `name` cut into `num_stages` stages, under the caller's torch seed.

    `name` is a built-in model (resnet18, gpt2, digits_cnn, digits_mlp, relay, transformers) or "package.module:function".
    """
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if ":" in name:
        return build_custom(name, num_stages, **options)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} or 'package.module:function'")
    reject_unknown(name, options, model_options(name))
    return MODELS[name](num_stages, **options)


def stage_count_problem(name: str, num_stages: int, options: dict) -> str | None:
    """Whether a built-in model splits into `num_stages` stages, asked before any peer starts: the
    builder runs on the meta device (no weights are made, no data read). None when it does, or when
    the question cannot be asked cheaply (a pretrained model's weights, a config named by a hub
    name, which a lookup would fetch, a user's function), or when building fails otherwise: the
    build that follows reports that in its place."""
    if ":" in name or name not in MODELS or options.get("pretrained") is not None:
        return None
    if isinstance(options.get("config"), str):  # gpt2's `config: gpt2-medium`
        return None
    try:
        with torch.device("meta"):
            build_model(name, num_stages, **options)
    except StageCountError as e:
        return str(e)
    except Exception:  # anything else (a forward that meta tensors cannot run) is the build's to say
        return None
    return None


def model_num_classes(name: str, options: dict) -> int | None:
    """A built-in classifier's number of outputs from its options (None: not a built-in classifier)."""
    if name not in MODELS or name == "transformers":
        return None
    parameter = inspect.signature(MODELS[name]).parameters.get("num_classes")
    if parameter is None:
        return None
    n = options.get("num_classes", parameter.default)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def model_vocab_size(name: str, options: dict) -> int | None:
    """A language model's vocabulary size from its options (None: not a built-in language model)."""
    if name == "transformers":
        return vocab_size(**options)
    if name == "gpt2":
        if options.get("pretrained") is not None:
            return vocab_size(pretrained=options["pretrained"])
        try:
            return make_config(options.get("config")).vocab_size
        except (ValueError, TypeError):
            return None
    return None
