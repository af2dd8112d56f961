"""Dataset names -> builders, with options checked against the fields of each builder's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from swarm.config.options import reject_unknown
from swarm.data.cifar import CifarOptions, build_cifar10
from swarm.data.custom import build_custom
from swarm.data.digits import DigitsOptions, build_digits
from swarm.data.images import ImagesOptions, build_images
from swarm.data.text import TextOptions, build_text
from swarm.data.wikitext import WikitextOptions, build_wikitext2


@dataclass(frozen=True)
class Dataset:
    """A built-in dataset: `build(data_dir, seed, options)` -> (train, test), and its options' dataclass
    (a config's `data.options` are its fields)."""

    build: Callable
    options: type


# swarm.config.experiment.DataConfig keeps its own copy of these names (importing swarm.data there
# would make swarm.config and swarm.data import each other); tests/data/test_local_data.py checks they agree.
DATASETS: dict[str, Dataset] = {
    "digits": Dataset(build_digits, DigitsOptions),
    "cifar10": Dataset(build_cifar10, CifarOptions),
    "wikitext2": Dataset(build_wikitext2, WikitextOptions),
    "text": Dataset(build_text, TextOptions),
    "images": Dataset(build_images, ImagesOptions),
}


def dataset_options(name: str) -> list[str]:
    return [f.name for f in fields(DATASETS[name].options)]


def build_datasets(name: str, data_dir: str | None = None, seed: int = 0, **options):
    """(train, test) datasets of (sample_id, input, target) items.

    digits: scikit-learn's bundled digits (offline); cifar10: torchvision download or an
    ImageFolder `data_dir`; wikitext2: the Hub or raw files in `data_dir`; text: local text,
    json, csv or parquet files; images: a local image folder; `package.module:function`: a
    function of the user's returning (train, test) (swarm.data.custom).
    """
    if ":" in name:
        return build_custom(name, data_dir=data_dir, seed=seed, **options)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, or package.module:function")
    reject_unknown(name, options, ["data_dir", "seed", *dataset_options(name)])
    dataset = DATASETS[name]
    return dataset.build(data_dir, seed, dataset.options(**options))
