"""Experiment configuration: pydantic models loaded from YAML, validated at load time.

A bad key or value fails with one line naming the field (`ConfigError`), never a traceback from
deep inside torch. `--set key.path=value` overrides are applied before validation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from swarm.compression.spec import SpecError, parse
from swarm.config.messages import yaml_problem
from swarm.config.schedule import DelayCorrection
from swarm.config.target import Target

_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{40,60}")  # a libp2p peer id in base58 (46 for an RSA key)

LANGUAGE_MODELS = ("transformers", "gpt2")  # the built-in models whose output is a causal LM's logits


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line and names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_spec(value: str | None) -> str | None:
    if value is None:
        return value
    try:
        parse(value)
    except SpecError as e:
        raise ValueError(str(e)) from None
    return value


class LinkConfig(_Strict):
    """Compression of one boundary: activations forward, gradients backward."""

    forward: str = "none"
    backward: str = "none"

    _forward_ok = field_validator("forward")(_check_spec)
    _backward_ok = field_validator("backward")(_check_spec)

    def check(self, where: str) -> None:
        if parse(self.backward).reuses_indices and not parse(self.forward).codec.sparse:
            raise ValueError(f"{where}: backward topk:reuse needs a topk forward codec on the same boundary")
        if parse(self.forward).reuses_indices:
            raise ValueError(f"{where}: topk:reuse is for the backward direction only")


class LinkOverride(_Strict):
    """A boundary's own settings; an unset direction keeps the default."""

    forward: str | None = None
    backward: str | None = None

    _forward_ok = field_validator("forward")(_check_spec)
    _backward_ok = field_validator("backward")(_check_spec)


class AdaptiveConfig(_Strict):
    """Swarm only: per boundary, the mildest setting of a ladder whose link time fits the slower
    neighbour's compute, from the bandwidth measured during training (swarm.transport.hivemind.trainer.adaptive).
    Switching codecs restarts the link's codec state (error feedback, reused indices) on both ends."""

    ladder: Literal["topk", "quant"] = "topk"  # topk:R with reused-index gradients, or quant:B both ways
    every: int = Field(1, ge=1)  # optimizer steps between decisions
    hysteresis: float = Field(0.15, ge=0, lt=1)  # back to a milder setting only with this much to spare
    # link ms per sample to stay under; default: the slower neighbour's compute
    target_ms: float | None = Field(None, gt=0)


class CompressionConfig(LinkConfig):
    """Defaults for every boundary, with per-boundary overrides (boundary i sits after stage i)."""

    boundaries: dict[int, LinkOverride] = Field(default_factory=dict)
    adaptive: AdaptiveConfig | None = None
    store_dir: str | None = None  # disk-backed AQ-SGD / per-sample EF buffers go here
    store_capacity: int | None = None  # samples per disk-backed buffer (the train set size)

    def link(self, boundary: int) -> LinkConfig:
        own = self.boundaries.get(boundary, LinkOverride())
        return LinkConfig(forward=own.forward or self.forward, backward=own.backward or self.backward)


class ModelConfig(_Strict):
    name: str = "digits_cnn"  # resnet18 | gpt2 | digits_cnn | package.module:function
    num_stages: int = Field(4, ge=1, le=64)
    options: dict[str, Any] = Field(default_factory=dict)


class DataConfig(_Strict):
    name: str = "digits"  # digits | cifar10 | wikitext2 | text | images | package.module:function
    data_dir: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        # swarm.data.registry.DATASETS' names, written out: importing swarm.data here would make
        # swarm.config and swarm.data import each other (tests/data/test_local_data.py checks they agree)
        builtin = ("digits", "cifar10", "wikitext2", "text", "images")
        module, colon, function = value.partition(":")
        if value in builtin or (
            colon
            and all(p.isidentifier() for p in function.split("."))
            and all(p.isidentifier() for p in module.split("."))
        ):
            return value
        raise ValueError(f"unknown dataset {value!r}; choose one of {', '.join(builtin)}, or package.module:function")


class OptimizerConfig(_Strict):
    # muon: Muon on the hidden blocks' matrices, AdamW on the rest (swarm.engine.muon); nadam:
    # AdamW's groups with Nesterov momentum and decoupled weight decay
    name: Literal["sgd", "adamw", "muon", "nadam"] = "sgd"
    lr: float = Field(0.1, gt=0)  # muon: Muon's rate
    adamw_lr: float | None = Field(None, gt=0)  # muon: the AdamW part's rate (default: lr / 10)
    momentum: float = Field(0.9, ge=0, lt=1)  # sgd's (default 0.9) or Muon's (default 0.95)
    weight_decay: float = Field(5e-4, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    schedule_epochs: float | None = Field(None, gt=0)  # schedule length; the run's length by default
    schedule_steps: int | None = Field(None, ge=1)  # ... or in steps (a run cut short by max_steps or a target)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine and linear decay to this fraction of the peak
    grad_clip: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _muon_momentum(cls, data: Any) -> Any:
        # Muon's momentum is 0.95 (torch's default, modded-nanogpt's); SGD's stays 0.9
        if isinstance(data, dict) and data.get("name") == "muon" and "momentum" not in data:
            data = {**data, "momentum": 0.95}
        return data

    @model_validator(mode="after")
    def _one_schedule_length(self) -> OptimizerConfig:
        if self.schedule_epochs is not None and self.schedule_steps is not None:
            raise ValueError("optimizer: schedule_epochs and schedule_steps both set; give the schedule's length once")
        if self.adamw_lr is not None and self.name != "muon":
            raise ValueError(f"optimizer.adamw_lr: only muon has a second rate (name is {self.name}; lr is its rate)")
        return self

    @property
    def adamw_rate(self) -> float:
        """The AdamW part's rate under muon."""
        return self.adamw_lr if self.adamw_lr is not None else self.lr / 10


class TrainConfig(_Strict):
    epochs: float = Field(1, gt=0)
    batch_size: int = Field(100, ge=1)
    micro_batches: int = Field(4, ge=1)
    eval_batch_size: int = Field(200, ge=1)
    eval_every: float = Field(1, gt=0)  # epochs between evaluations
    eval_compressed: bool = True  # evaluate with compression on as well as off
    warmup_epochs: float = Field(0, ge=0)  # uncompressed epochs first (fills AQ-SGD buffers)
    max_steps: int | None = Field(None, ge=1)
    in_flight: int | None = Field(None, ge=1)  # micro-batches in a swarm's pipeline at once (default: 2 x stages)
    precision: Literal["fp32", "bf16", "fp16"] = (
        "fp32"  # autocast dtype of every stage's forward (swarm.engine.precision)
    )
    checkpoint_activations: bool = False  # recompute each stage's forward in its backward: less memory per micro-batch
    target: str | None = None  # METRIC=VALUE: stop once an evaluation reaches it (swarm.config.target)
    # sync: every step applies its own gradients; async: the step before's (swarm.engine.delay)
    schedule: Literal["sync", "async"] = "sync"
    # async: lookahead (the default: weights predicted one update ahead), none, or dc:LAMBDA
    # (delay-compensated gradients); sync: none
    delay_correction: str = "none"
    # a swarm runs this fraction of training micro-batches a second time, on another peer of a
    # replicated stage, and compares that stage's gradient digests: their bits (tolerance 0), or
    # their squared norms within this relative tolerance (a model whose kernels are not deterministic)
    verify: float = Field(0, ge=0, le=1)
    verify_tolerance: float = Field(0, ge=0)
    # a peer admitted mid-run has every micro-batch it serves checked (against a trusted peer) until
    # this many of its results matched; only then its work counts unchecked (0: checked at `verify`'s
    # fraction, trusted after its first match). A new identity costs a key, this costs compute.
    verify_probation: int = Field(0, ge=0)
    # peer ids of verifiers the owner trusts (`python -m peers.verifier`): each serves a stage like a
    # replica but gets micro-batches only to check another peer's (a stage of one peer is checked too)
    verifiers: list[str] = Field(default_factory=list, max_length=64)
    # a language model's sample through the pipeline at every Nth evaluation (0: none), printed
    # beside the loss and written to the results (swarm.training.sampling)
    sample_every: int = Field(0, ge=0)
    sample_prompt: str | None = Field(None, min_length=1)  # default: the start of the test split's first block
    sample_tokens: int = Field(32, ge=1)  # new tokens per sample
    sample_temperature: float = Field(0.0, ge=0, allow_inf_nan=False)  # 0: greedy

    @model_validator(mode="before")
    @classmethod
    def _async_looks_ahead(cls, data: Any) -> Any:
        # measured best of none, lookahead and dc (docs/configs.md "Muon and the asynchronous schedule")
        if isinstance(data, dict) and data.get("schedule") == "async" and "delay_correction" not in data:
            data = {**data, "delay_correction": "lookahead"}
        return data

    @field_validator("delay_correction")
    @classmethod
    def _correction_parses(cls, value: str) -> str:
        DelayCorrection.parse(value)
        return value

    @field_validator("target")
    @classmethod
    def _target_parses(cls, value: str | None) -> str | None:
        if value is not None:
            Target.parse(value)
        return value

    @model_validator(mode="after")
    def _micro_batches_fit(self) -> TrainConfig:
        if self.micro_batches > self.batch_size:
            raise ValueError(f"micro_batches ({self.micro_batches}) cannot exceed batch_size ({self.batch_size})")
        return self

    @model_validator(mode="after")
    def _probation_is_verified(self) -> TrainConfig:
        if self.verify_probation and not self.verify:
            raise ValueError("verify_probation checks new peers' results: it needs verify > 0 (the stages' digests)")
        if self.verifiers and not self.verify:
            raise ValueError("verifiers check other peers' results: they need verify > 0")
        if self.verifiers and self.verify_tolerance:
            raise ValueError(
                "verifiers compare the stages' signed accounts, which need exact results: verify_tolerance 0"
            )
        for peer in self.verifiers:
            if not _PEER_ID.fullmatch(peer):
                raise ValueError(
                    f"verifiers: {peer[:70]!r} is not a peer id (python -m peers.verifier --print_id prints it)"
                )
        return self


class ReportConfig(_Strict):
    """Where a run appears in `python -m swarm report` (paper-shaped tables)."""

    table: str = "Runs"  # e.g. "Table 2: TopK"
    row: str | None = None  # row label; the run name by default
    paper: dict[str, float] = Field(default_factory=dict)  # the paper's figures for this row, side by side


class ExperimentConfig(_Strict):
    name: str = "experiment"
    report: ReportConfig = Field(default_factory=ReportConfig)
    seed: int = 0
    device: str = "cpu"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)

    @model_validator(mode="after")
    def _links_fit_the_model(self) -> ExperimentConfig:
        boundaries = self.model.num_stages - 1
        extra = sorted(b for b in self.compression.boundaries if not 0 <= b < boundaries)
        if extra:
            raise ValueError(
                f"compression.boundaries: {self.model.num_stages} stages have boundaries 0..{boundaries - 1}, got {extra}"
            )
        for b in range(max(boundaries, 1)):
            self.compression.link(b).check(f"compression (boundary {b})")
        if self.train.sample_every and self.model.name not in LANGUAGE_MODELS:
            raise ValueError(
                f"train.sample_every: samples need a language model (model {' or '.join(LANGUAGE_MODELS)}), not {self.model.name}"
            )
        if self.compression.adaptive is not None and boundaries < 1:
            raise ValueError(
                "compression.adaptive: a 1-stage model has no links to adapt (model.num_stages must be at least 2)"
            )
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda") and value != "mps":
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {value!r}")
        return value


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {message}{more}"


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b.c=value` (YAML value) into a nested dict."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return raw


def config_from_text(text: str, overrides: list[str], where: str) -> ExperimentConfig:
    """A config from YAML `text` and `--set` overrides; `where` names the text in errors (a file, a run)."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping")
    raw = apply_overrides(raw, overrides)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    if path is None:
        return config_from_text("", overrides or [], "config")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file (not UTF-8 at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    if not any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines()):
        # an empty file would train the defaults: far more likely a file saved empty by mistake
        raise ConfigError(f"{path}: the config file is empty (no setting in it)")
    return config_from_text(text, overrides or [], str(path))
