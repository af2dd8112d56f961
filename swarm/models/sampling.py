"""The next token of a language model's sample, picked where the logits are: in the last stage.

A sample through a pipeline (swarm.training.sampling) is a sequence of evaluation micro-batches
whose targets are not labels but a sample request: per row, a temperature and a uniform draw the
trainer made from a generator of its own. The last stage's metrics (`causal_lm_metrics`) then
carry the token it picked instead of sums: at temperature 0 the most likely one (greedy), else the
token whose slice of the cumulative distribution of softmax(logits / temperature) holds the draw
(inverse-CDF sampling, in float64). No logits cross a link, one number per row comes back, and no
stage draws a random number: a sample changes no generator a training step uses.
"""

from __future__ import annotations

import torch

TOKEN = "token."  # metrics key prefix: token.<row>


def sample_request(temperature: float, draws: torch.Tensor) -> torch.Tensor:
    """The targets asking for the next token of each row: [rows, 2] float64 (temperature, draw in [0, 1))."""
    draws = draws.to(torch.float64).reshape(-1, 1)
    return torch.cat([torch.full_like(draws, float(temperature)), draws], dim=1)


def is_sample_request(targets: torch.Tensor) -> bool:
    """Whether a micro-batch's targets are a sample request (a language model's labels are integers)."""
    return targets.is_floating_point() and targets.dim() == 2 and targets.shape[1] == 2


def request_problem(request: torch.Tensor) -> str | None:
    """What is wrong with a sample request's numbers (None: nothing): temperatures >= 0, draws in [0, 1]."""
    temperatures, draws = request[:, 0], request[:, 1]
    if not bool(torch.isfinite(request).all()) or bool((temperatures < 0).any()):
        return "a sample request's temperatures must be finite numbers >= 0"
    if bool(((draws < 0) | (draws > 1)).any()):
        return "a sample request's draws must be in [0, 1]"
    return None


def pick(logits: torch.Tensor, temperature: float, draw: float) -> int:
    """The token of one row's next-token `logits` [vocab] at `temperature` for the uniform `draw`."""
    logits = logits.detach().double()
    if temperature <= 0:
        return int(logits.argmax())
    cumulative = torch.softmax(logits / temperature, dim=-1).cumsum(dim=-1)
    index = torch.searchsorted(cumulative, torch.tensor([draw * float(cumulative[-1])], dtype=torch.float64))
    return int(index.clamp(max=logits.numel() - 1))


def picked_tokens(logits: torch.Tensor, request: torch.Tensor) -> dict[str, float]:
    """The metrics of a sample request: the next token of each row of `logits` [rows, T, vocab]."""
    return {
        f"{TOKEN}{row}": float(pick(logits[row, -1], float(temperature), float(draw)))
        for row, (temperature, draw) in enumerate(request.tolist())
    }


def tokens_of(metrics: dict[str, float]) -> list[int]:
    """The tokens a sample request's metrics carry, by row."""
    rows = sorted(int(key.removeprefix(TOKEN)) for key in metrics if key.startswith(TOKEN))
    return [int(metrics[f"{TOKEN}{row}"]) for row in rows]
