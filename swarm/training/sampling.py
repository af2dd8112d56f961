"""A language model's sample through the pipeline at an evaluation (`train.sample_every`), as
people watch a language model learn.

Each new token is one evaluation micro-batch of one row: the prompt and the tokens so far (the
last `block_size`, the lengths the model trained on) go in at stage 0, uncompressed, and the last
stage answers the sample request its targets carry with the token it picked
(swarm.models.sampling). Evaluation micro-batches change no training state: no gradient, no error
feedback or reused index (links encode them statelessly), dropout off, and no generator a step
draws from (the draws come from a generator of the sampler's, seeded by the run's seed and the
step). A run with samples has the losses of one without, and a swarm samples what one process
samples.
"""

from __future__ import annotations

import hashlib

import torch

from swarm.config import ExperimentConfig
from swarm.data.tokenizer import data_tokenizer, prompt_ids
from swarm.engine.microbatch import MicroBatch, Mode
from swarm.models.sampling import sample_request, tokens_of


def _generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"hivepipe sample {seed} {step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class PipelineSampler:
    """Samples `cfg.train.sample_tokens` tokens after `prompt` (token ids) through a pipeline."""

    def __init__(self, cfg: ExperimentConfig, tokenizer, prompt: list[int], block_size: int) -> None:
        self.cfg, self.tokenizer, self.prompt, self.block_size = cfg, tokenizer, list(prompt), block_size
        self.stop = getattr(tokenizer, "eos_token_id", None)

    @classmethod
    def of(cls, cfg: ExperimentConfig, data) -> PipelineSampler | None:
        """The run's sampler (None without train.sample_every); ValueError in one line when the
        data has no tokenizer to read a sample with, or no token blocks to take a prompt from."""
        if not cfg.train.sample_every:
            return None
        tokenizer = data_tokenizer(cfg.data.name, cfg.data.options)
        blocks = [getattr(split, "blocks", None) for split in reversed(data)]  # the test split's first
        blocks = [b for b in blocks if isinstance(b, torch.Tensor) and b.dim() == 2 and len(b)]
        if tokenizer is None or not blocks:
            raise ValueError(
                f"train.sample_every: data {cfg.data.name} names no tokenizer to read a sample with (text or wikitext2 data do)"
            )
        block_size = int(blocks[0].shape[1])
        if cfg.train.sample_prompt is not None:
            prompt = prompt_ids(tokenizer, cfg.train.sample_prompt)
        else:
            prompt = blocks[0][0, : max(1, block_size // 2)].tolist()
        if not prompt:
            raise ValueError(f"train.sample_prompt {cfg.train.sample_prompt!r} gives no tokens")
        return cls(cfg, tokenizer, prompt, block_size)

    def due(self, evaluations: int) -> bool:
        """Whether the evaluation numbered `evaluations` (from 1) gets a sample."""
        return evaluations % self.cfg.train.sample_every == 0

    def sample(self, pipeline, step: int) -> dict:
        """The results row of a sample at `step` ({"type": "sample", "step", "prompt", "text", "tokens",
        "temperature"})."""
        temperature = self.cfg.train.sample_temperature
        generator = _generator(self.cfg.seed, step)
        tokens = list(self.prompt)
        for index in range(self.cfg.train.sample_tokens):
            context = torch.tensor([tokens[-self.block_size :]], dtype=torch.long)
            draw = torch.rand(1, generator=generator, dtype=torch.float64)
            batch = MicroBatch(
                step, index, torch.zeros(1, dtype=torch.long), sample_request(temperature, draw), Mode.EVAL, 1.0, True
            )
            token = tokens_of(pipeline.run_many([(batch, context)])[0])[0]
            tokens.append(token)
            if token == self.stop:
                break
        new = tokens[len(self.prompt) :]
        return {
            "type": "sample",
            "step": step,
            "prompt": self.tokenizer.decode(self.prompt, skip_special_tokens=True),
            "text": self.tokenizer.decode(new, skip_special_tokens=True),
            "tokens": new,
            "temperature": temperature,
        }
