"""Dataset names -> builders, with options checked against each builder's signature."""

from __future__ import annotations

from collections.abc import Callable

from swarm.config.options import accepted_options, reject_unknown
from swarm.data.cifar import build_cifar10
from swarm.data.custom import build_custom
from swarm.data.digits import build_digits
from swarm.data.images import build_images
from swarm.data.text import build_text
from swarm.data.wikitext import build_wikitext2

# swarm.config.experiment.DataConfig keeps its own copy of these names (importing swarm.data there
# would make swarm.config and swarm.data import each other); tests/data/test_local_data.py checks they agree.
DATASETS: dict[str, Callable] = {
    "digits": build_digits,
    "cifar10": build_cifar10,
    "wikitext2": build_wikitext2,
    "text": build_text,
    "images": build_images,
}


def dataset_options(name: str) -> list[str]:
    return accepted_options(DATASETS[name], skip=("data_dir",))


def build_datasets(name: str, data_dir: str | None = None, **options):
    """(train, test) datasets of (sample_id, input, target) items.

    digits: scikit-learn's bundled digits (offline); cifar10: torchvision download or an
    ImageFolder `data_dir`; wikitext2: the Hub or raw files in `data_dir`; text: local text,
    json, csv or parquet files; images: a local image folder; `package.module:function`: a
    function of the user's returning (train, test) (swarm.data.custom).
    """
    if ":" in name:
        return build_custom(name, data_dir=data_dir, **options)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, or package.module:function")
    reject_unknown(name, options, ["data_dir", *dataset_options(name)])
    return DATASETS[name](data_dir=data_dir, **options)
