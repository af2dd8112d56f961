"""Datasets: (id, input, target) items, stable ids, reproducible augmentation, tiny local data only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from _util import write_tiny_tokenizer
from PIL import Image
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader
from transformers import GPT2TokenizerFast

from swarm.data import balanced_subset, build_datasets, collate, group_texts
from swarm.data.augment import CIFAR10_MEAN, CIFAR10_STD
from swarm.data.wikitext import split_rows


def loader(dataset, batch_size: int, seed: int | None = None, epoch: int = 0) -> DataLoader:
    """Batches as the training loop makes them: the dataset set to `epoch`, swarm.data.collate, and
    with a `seed`, shuffled by a generator seeded with it."""
    dataset.set_epoch(epoch)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=seed is not None, generator=generator, collate_fn=collate)


# ---- digits -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return build_datasets("digits")


def test_digits_items_and_split(digits):
    train, test = digits
    assert (len(train), len(test)) == (1500, 297)
    sample_id, x, y = train[0]
    assert isinstance(sample_id, int) and isinstance(y, int) and 0 <= y < 10
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    train_ids, test_ids = set(train.ids.tolist()), set(test.ids.tolist())
    assert len(train_ids) == 1500 and not train_ids & test_ids
    assert train_ids | test_ids == set(range(1797))
    images = torch.stack([train[i][1] for i in range(len(train))])
    assert abs(float(images.mean())) < 1e-4 and abs(float(images.std()) - 1) < 1e-3


def test_digits_ids_are_stable_and_match_sklearn(digits):
    train, _ = digits
    again, _ = build_datasets("digits")
    assert torch.equal(train.ids, again.ids)
    labels = load_digits().target
    for i in (0, 17, 1499):
        sample_id, x, y = train[i]
        assert y == labels[sample_id]
        assert torch.equal(x, again[i][1])
    other, _ = build_datasets("digits", split_seed=1)
    assert not torch.equal(other.ids, train.ids)


def test_digits_upscale_and_subset():
    train, test = build_datasets("digits", upscale=True, subset=100)
    assert train[0][1].shape == (3, 32, 32) and test[0][1].shape == (3, 32, 32)
    labels = [train[i][2] for i in range(len(train))]
    assert len(train) == 100 and np.bincount(labels).tolist() == [10] * 10


def test_digits_test_subset_is_a_balanced_part_of_the_test_split_and_leaves_training_alone(digits):
    train, test = digits
    kept_train, kept = build_datasets("digits", test_subset=50)
    assert torch.equal(kept_train.ids, train.ids) and torch.equal(kept_train.images, train.images)
    assert len(kept) == 50 and set(kept.ids.tolist()) < set(test.ids.tolist())
    assert np.bincount([kept[i][2] for i in range(len(kept))]).tolist() == [5] * 10
    with pytest.raises(ValueError, match="digits test: subset=400 is larger than the 297 samples"):
        build_datasets("digits", test_subset=400)


def test_collate_batches_ids_inputs_targets(digits):
    """Every row of a batch is the dataset's item of that id, whatever order the loader draws."""
    train, _ = digits
    ids, x, y = next(iter(loader(train, 16, seed=3, epoch=2)))
    assert ids.dtype == torch.long and ids.shape == (16,)
    assert x.shape == (16, 1, 8, 8) and y.dtype == torch.long and y.shape == (16,)
    index = {int(i): k for k, i in enumerate(train.ids)}
    for sample_id, xi, yi in zip(ids.tolist(), x, y.tolist(), strict=True):
        _, x_ref, y_ref = train[index[sample_id]]
        assert torch.equal(xi, x_ref) and yi == y_ref


def test_collate_tensor_targets():
    ids, x, y = collate([(4, torch.zeros(3), torch.arange(3)), (9, torch.ones(3), torch.arange(3) + 1)])
    assert ids.dtype == torch.long and ids.tolist() == [4, 9]
    assert torch.equal(x, torch.stack([torch.zeros(3), torch.ones(3)]))
    assert torch.equal(y, torch.stack([torch.arange(3), torch.arange(3) + 1]))


# ---- CIFAR-10 from an ImageFolder ----------------------------------------------------------------

CLASSES = ["airplane", "automobile", "bird"]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for c in CLASSES:
            (root / split / c).mkdir(parents=True)
            for k in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{k:04d}.png")
    return root


def _candidates(path) -> list[torch.Tensor]:
    """Every output torchvision's RandomCrop(32, padding=4) + RandomHorizontalFlip can give."""
    image = Image.open(path).convert("RGB")
    padded = TF.pad(image, 4)
    out = []
    for top in range(9):
        for left in range(9):
            crop = TF.crop(padded, top, left, 32, 32)
            for flipped in (crop, TF.hflip(crop)):
                out.append(TF.normalize(TF.to_tensor(flipped), CIFAR10_MEAN, CIFAR10_STD))
    return out


def test_cifar_image_folder_items(image_folder):
    train, test = build_datasets("cifar10", data_dir=str(image_folder))
    assert (len(train), len(test)) == (12, 6)
    assert train.classes == CLASSES and train.num_classes == 3
    assert train.ids.tolist() == list(range(12)) and test.ids.tolist() == list(range(12, 18))
    sample_id, x, y = test[3]
    assert sample_id == 15 and y == 1 and x.shape == (3, 32, 32)
    expected = TF.normalize(
        TF.to_tensor(Image.open(image_folder / "test" / "automobile" / "0001.png")), CIFAR10_MEAN, CIFAR10_STD
    )
    assert torch.allclose(x, expected, atol=1e-6)
    # a train item is one of the paper's augmentations of its image
    _, xa, ya = train[5]
    assert ya == 1
    candidates = _candidates(image_folder / "train" / "automobile" / "0001.png")
    assert any(torch.allclose(xa, c, atol=1e-6) for c in candidates)


def test_cifar_augmentation_is_reproducible(image_folder):
    train, _ = build_datasets("cifar10", data_dir=str(image_folder), seed=7)
    again, _ = build_datasets("cifar10", data_dir=str(image_folder), seed=7)
    first = [train[i][1] for i in range(len(train))]
    backwards = [again[i][1] for i in reversed(range(len(again)))][::-1]  # order does not matter
    assert all(torch.equal(a, b) for a, b in zip(first, backwards, strict=True))
    train.set_epoch(1)
    epoch1 = [train[i][1] for i in range(len(train))]
    assert sum(not torch.equal(a, b) for a, b in zip(first, epoch1, strict=True)) >= len(train) // 2
    other, _ = build_datasets("cifar10", data_dir=str(image_folder), seed=8)
    assert sum(not torch.equal(a, other[i][1]) for i, a in enumerate(first)) >= len(train) // 2
    batches = [next(iter(loader(ds, 12, seed=1, epoch=4))) for ds in (train, again)]
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])
    plain, test = build_datasets("cifar10", data_dir=str(image_folder), augment=False)
    unaugmented = TF.normalize(
        TF.to_tensor(Image.open(image_folder / "train" / "airplane" / "0000.png")), CIFAR10_MEAN, CIFAR10_STD
    )
    assert torch.allclose(plain[0][1], unaugmented, atol=1e-6)
    test.set_epoch(5)  # test items never depend on seed or epoch
    assert torch.equal(test[0][1], build_datasets("cifar10", data_dir=str(image_folder), seed=9)[1][0][1])


def test_cifar_subset_and_preload(image_folder):
    train, test = build_datasets("cifar10", data_dir=str(image_folder), subset=6, test_subset=3)
    assert len(train) == 6 and len(test) == 3
    assert sorted(train[i][2] for i in range(6)) == [0, 0, 1, 1, 2, 2]
    for i in range(6):  # ids stay the indices into the full train split
        sample_id, _, y = train[i]
        assert y == sample_id // 4
    assert all(sample_id >= 12 for sample_id in test.ids.tolist())
    same, _ = build_datasets("cifar10", data_dir=str(image_folder), subset=6, test_subset=3)
    assert torch.equal(train.ids, same.ids)
    loaded, _ = build_datasets("cifar10", data_dir=str(image_folder), subset=6, preload=True)
    assert isinstance(loaded.images, np.ndarray)
    assert all(torch.equal(loaded[i][1], train[i][1]) for i in range(6))
    with pytest.raises(ValueError, match="subset=6 needs 2 samples of class 1, only 1 exist"):
        balanced_subset([0, 0, 0, 1, 2, 2], 6, seed=0, name="cifar10")
    with pytest.raises(ValueError, match="larger than the 12 samples"):
        build_datasets("cifar10", data_dir=str(image_folder), subset=13)


def test_cifar_errors(tmp_path, image_folder):
    with pytest.raises(ValueError, match="data_dir .* does not exist"):
        build_datasets("cifar10", data_dir=str(tmp_path / "nowhere"))
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match="folder .*test.* does not exist"):
        build_datasets("cifar10", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown option.*colour"):
        build_datasets("cifar10", data_dir=str(image_folder), colour=True)
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        build_datasets("imagenet")


# ---- WikiText ---------------------------------------------------------------------------------


def test_group_texts_as_run_clm():
    rows = [[1, 2, 3], [], [4, 5], [6, 7, 8, 9, 10]]
    assert group_texts(rows, 4, group_rows=None) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # run_clm groups each map batch separately and drops each batch's remainder
    assert group_texts(rows, 2, group_rows=2) == [[1, 2], [4, 5], [6, 7], [8, 9]]
    assert group_texts(rows, 20) == []
    with pytest.raises(ValueError, match="block_size"):
        group_texts(rows, 0)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny byte-level BPE in GPT-2's file format: 256 bytes, three merges, <|endoftext|>."""
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


TRAIN_TEXT = (
    "\n = First = \n\n the cat sat on the mat . \n\n = = Part = = \n\n the end of the first . \n"
    "\n = Second article = \n\n the other text here . \n"
)
VALID_TEXT = "\n = Second = \n\n the dog ran . \n"


@pytest.fixture(scope="module")
def wiki_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wikitext")
    (root / "wiki.train.raw").write_text(TRAIN_TEXT, encoding="utf-8")
    (root / "wiki.valid.raw").write_text(VALID_TEXT, encoding="utf-8")
    return root


def test_wikitext_blocks_from_local_files(wiki_dir, tokenizer_dir):
    tok = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    train, test = build_datasets("wikitext2", data_dir=str(wiki_dir), tokenizer=str(tokenizer_dir), block_size=8)
    rows = [line if line.strip() else "" for line in TRAIN_TEXT.splitlines(keepends=True)]
    tokens = [t for row in rows for t in tok(row)["input_ids"]]
    assert len(train) == len(tokens) // 8
    assert train.vocab_size == 260
    for i in range(len(train)):
        sample_id, x, y = train[i]
        assert sample_id == i and x.dtype == torch.long and x.shape == (8,)
        assert torch.equal(x, y) and x.tolist() == tokens[8 * i : 8 * i + 8]
    assert tok.decode(torch.cat([train[i][1] for i in range(len(train))]).tolist()) == tok.decode(
        tokens[: 8 * len(train)]
    )
    assert test.ids.tolist() == list(range(len(train), len(train) + len(test)))
    valid_tokens = tok([r if r.strip() else "" for r in VALID_TEXT.splitlines(keepends=True)])["input_ids"]
    assert len(test) == sum(map(len, valid_tokens)) // 8
    ids, x, y = next(iter(loader(train, 2)))
    assert ids.tolist() == [0, 1] and x.shape == (2, 8) and torch.equal(x, y)
    # a tokenizer object works as well as a directory
    again, _ = build_datasets("wikitext2", data_dir=str(wiki_dir), tokenizer=tok, block_size=8)
    assert torch.equal(again.blocks, train.blocks)


def test_wikitext_single_file_split(wiki_dir, tokenizer_dir):
    rows = [line if line.strip() else "" for line in TRAIN_TEXT.splitlines(keepends=True)]
    head, tail = split_rows(rows, 0.3)  # the cut moves forward to the next article, not to a sub-heading
    assert head + tail == rows
    assert tail[0] == " = Second article = \n" and len(head) > int(0.3 * len(rows))
    train, test = build_datasets(
        "wikitext2",
        data_dir=str(wiki_dir),
        tokenizer=str(tokenizer_dir),
        block_size=4,
        train_file="wiki.train.raw",
        test_file="wiki.train.raw",
        train_fraction=0.5,
    )
    tok = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    head, tail = split_rows(rows, 0.5)  # train: the rows before the cut, test: the rest

    def blocks(part: list[str]) -> list[list[int]]:
        return group_texts([tok(row)["input_ids"] for row in part], 4)

    assert train.blocks.tolist() == blocks(head) and len(train) > 0
    assert test.blocks.tolist() == blocks(tail) and len(test) > 0
    assert not set(train.ids.tolist()) & set(test.ids.tolist())


def test_wikitext_errors(wiki_dir, tokenizer_dir, tmp_path):
    with pytest.raises(
        ValueError, match="test_file .*wiki.test.raw.* does not exist .*files there: wiki.train.raw, wiki.valid.raw"
    ):
        build_datasets("wikitext2", data_dir=str(wiki_dir), tokenizer=str(tokenizer_dir), test_file="wiki.test.raw")
    with pytest.raises(ValueError, match="data_dir .* does not exist"):
        build_datasets("wikitext2", data_dir=str(tmp_path / "missing"), tokenizer=str(tokenizer_dir))
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        build_datasets("wikitext2", data_dir=str(wiki_dir), tokenizer=str(tmp_path / "no_tokenizer"))
    with pytest.raises(ValueError, match="train_fraction must be between 0 and 1"):
        build_datasets(
            "wikitext2",
            data_dir=str(wiki_dir),
            tokenizer=str(tokenizer_dir),
            test_file="wiki.train.raw",
            train_fraction=1.5,
        )
    with pytest.raises(ValueError, match="block_size must be an integer"):
        build_datasets("wikitext2", data_dir=str(wiki_dir), tokenizer=str(tokenizer_dir), block_size=1)
