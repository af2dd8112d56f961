"""Data: datasets of (sample_id, input, target) with stable ids, reproducible augmentation,
and a collate that makes batches (ids, inputs, targets)."""

from swarm.data.base import SampleDataset, balanced_subset, collate, mix_seed
from swarm.data.cifar import CifarDataset
from swarm.data.custom import IndexedDataset, build_custom
from swarm.data.digits import DigitsDataset
from swarm.data.images import ImageFolderDataset, build_images
from swarm.data.registry import DATASETS, build_datasets, dataset_options
from swarm.data.text import build_text
from swarm.data.wikitext import TokenBlocks, group_texts, load_tokenizer

__all__ = [
    "DATASETS",
    "CifarDataset",
    "DigitsDataset",
    "ImageFolderDataset",
    "IndexedDataset",
    "SampleDataset",
    "TokenBlocks",
    "balanced_subset",
    "build_custom",
    "build_datasets",
    "build_images",
    "build_text",
    "collate",
    "dataset_options",
    "group_texts",
    "load_tokenizer",
    "mix_seed",
]
