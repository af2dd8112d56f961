"""Users' own data: text files, image folders and package.module:function datasets (tiny files in tmp_path)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _util import one_line_error, write_tiny_tokenizer
from PIL import Image

from swarm.config import ConfigError, load_config
from swarm.data import DATASETS, build_datasets, group_texts
from swarm.data.augment import cifar_train_transform, normalize, to_tensor
from swarm.data.base import mix_seed
from swarm.data.text import load_auto_tokenizer

# ---- text ---------------------------------------------------------------------------------------

WORDS = "the cat sat on the mat and the dog ran to the hat".split()
ROWS = [" ".join(WORDS[i % 7 :] + WORDS[: i % 7]) + " .\n" for i in range(20)] + ["\n", "the last row\n"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def write_rows(path, rows, column: str = "text") -> None:
    """`rows` as a file of the format its extension names (other columns beside the text one)."""
    suffix = path.suffix
    if suffix in (".txt", ".raw", ".dat"):
        path.write_text("".join(rows), encoding="utf-8")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"n": i, column: r}) + "\n" for i, r in enumerate(rows)), encoding="utf-8")
    elif suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["n", column])
            writer.writerows([i, r] for i, r in enumerate(rows))
    elif suffix == ".parquet":
        pq.write_table(pa.table({"n": list(range(len(rows))), column: rows}), path)
    else:
        raise AssertionError(suffix)


def expected_blocks(tok_dir, rows, block_size: int) -> list[list[int]]:
    tok = load_auto_tokenizer(str(tok_dir))
    return group_texts([tok(r)["input_ids"] for r in rows], block_size)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv", ".parquet"])
def test_text_formats_give_the_same_blocks(tmp_path, tok_dir, suffix):
    write_rows(tmp_path / f"data{suffix}", ROWS)
    train, test = build_datasets(
        "text", data_dir=str(tmp_path), files=[f"data{suffix}"], tokenizer=str(tok_dir), block_size=8, test_fraction=0
    )
    assert train.blocks.tolist() == expected_blocks(tok_dir, ROWS, 8)
    assert len(test) == 0 and train.vocab_size == 260
    sample_id, x, y = train[3]
    assert sample_id == 3 and x.shape == (8,) and x.dtype == torch.long and torch.equal(x, y)


def test_text_ids_are_stable_and_the_test_split_is_the_tail(tmp_path, tok_dir, monkeypatch):
    write_rows(tmp_path / "data.jsonl", ROWS)
    options = dict(files=str(tmp_path / "data.jsonl"), tokenizer=str(tok_dir), block_size=4, test_fraction=0.25)
    train, test = build_datasets("text", seed=1, **options)
    again, again_test = build_datasets("text", seed=2, **options)
    assert torch.equal(train.ids, again.ids) and torch.equal(train.blocks, again.blocks)
    assert torch.equal(test.ids, again_test.ids) and torch.equal(test.blocks, again_test.blocks)
    assert train.ids.tolist() == list(range(len(train)))
    assert test.ids.tolist() == list(range(len(train), len(train) + len(test))) and len(test) > 0
    cut = len(ROWS) - int(len(ROWS) * 0.25)
    assert train.blocks.tolist() == expected_blocks(tok_dir, ROWS[:cut], 4)
    assert test.blocks.tolist() == expected_blocks(tok_dir, ROWS[cut:], 4)
    # by default the last tenth of the rows is the test split; files relative to the cwd without data_dir
    monkeypatch.chdir(tmp_path)
    default, default_test = build_datasets("text", files="data.jsonl", tokenizer=str(tok_dir), block_size=4)
    cut = len(ROWS) - len(ROWS) // 10
    assert default.blocks.tolist() == expected_blocks(tok_dir, ROWS[:cut], 4)
    assert default_test.blocks.tolist() == expected_blocks(tok_dir, ROWS[cut:], 4)


def test_text_test_files_globs_format_and_tokenizer_object(tmp_path, tok_dir):
    (tmp_path / "parts").mkdir()
    write_rows(tmp_path / "parts" / "b.txt", ROWS[10:])
    write_rows(tmp_path / "parts" / "a.txt", ROWS[:10])
    write_rows(tmp_path / "held.dat", ROWS[:6])
    tok = load_auto_tokenizer(str(tok_dir))
    train, test = build_datasets(
        "text", data_dir=str(tmp_path), files="parts/*.txt", test_files=["held.dat"], tokenizer=tok, block_size=8
    )
    assert train.blocks.tolist() == expected_blocks(tok_dir, ROWS, 8)  # globs expand in name order
    assert test.blocks.tolist() == expected_blocks(tok_dir, ROWS[:6], 8)
    assert test.ids.tolist() == list(range(len(train), len(train) + len(test)))
    # format= reads any extension, and field= picks the column
    (tmp_path / "rows.dat").write_text("".join(json.dumps({"body": r}) + "\n" for r in ROWS), encoding="utf-8")
    same, _ = build_datasets(
        "text",
        files=str(tmp_path / "rows.dat"),
        format="jsonl",
        field="body",
        tokenizer=tok,
        block_size=8,
        test_fraction=0,
    )
    assert torch.equal(same.blocks, train.blocks)


def test_records_without_text_are_empty_rows_and_counted(tmp_path, tok_dir, capsys):
    records = [{"text": "one two"}, {"content": "a misspelt key"}, {"text": None}, {"text": "three"}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    write_rows(tmp_path / "clean.jsonl", ROWS)
    options = dict(tokenizer=str(tok_dir), block_size=2, test_fraction=0.0)
    build_datasets("text", files=str(tmp_path / "clean.jsonl"), **options)
    assert capsys.readouterr().err == ""
    train, _ = build_datasets("text", files=str(tmp_path / "mixed.jsonl"), **options)
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "2 of 4 records of" in note and "no 'text' value" in note
    assert len(train) == len(expected_blocks(tok_dir, ["one two", "", "", "three"], 2))


def test_text_errors_are_one_line(tmp_path, tok_dir):
    write_rows(tmp_path / "data.csv", ROWS)
    write_rows(tmp_path / "data.txt", ROWS)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{not json\n')
    (tmp_path / "nodir").write_text("")
    ok = dict(files=str(tmp_path / "data.txt"), tokenizer=str(tok_dir), block_size=8)

    def text(**changes):
        return build_datasets("text", **{**ok, **changes})

    one_line_error("text: files file .*missing.txt' does not exist \\(a relative name", text, files="missing.txt")
    one_line_error("text: files pattern .* matches no file", text, files=str(tmp_path / "*.md"))
    one_line_error("text: test_files file .*gone.txt' does not exist", text, test_files=["gone.txt"])
    one_line_error("text: files is required", text, files=None)
    one_line_error("text: tokenizer is required", text, tokenizer=None)
    for bad in (0, 1, True, "8", 2.0):
        one_line_error("text: block_size must be an integer >= 2", text, block_size=bad)
    one_line_error("text: group_rows must be", text, group_rows=0)
    one_line_error("text: format must be one of", text, format="xml")
    one_line_error("text: test_fraction must be a number in", text, test_fraction=1.0)
    one_line_error("text: give test_files or test_fraction", text, test_files=ok["files"], test_fraction=0.1)
    message = one_line_error(
        "text: record 1 of .* has no column 'body'", text, files=str(tmp_path / "data.csv"), field="body"
    )
    assert "columns: n, text" in message
    one_line_error("text: column 'n' of .* holds int values", text, files=str(tmp_path / "data.csv"), field="n")
    one_line_error("text: cannot read .*bad.jsonl' as json", text, files=str(tmp_path / "bad.jsonl"))
    one_line_error("text: the train files hold no text", text, files=str(tmp_path / "empty.txt"))
    one_line_error("text: the train text has .* tokens, not one block of block_size=4096", text, block_size=4096)
    one_line_error("text: cannot load tokenizer .* as a directory", text, tokenizer=str(tmp_path))
    one_line_error("text: cannot load tokenizer .*no-such-tok", text, tokenizer=str(tmp_path / "no-such-tok"))
    one_line_error("text: data_dir .* does not exist", text, data_dir=str(tmp_path / "nowhere"))
    one_line_error("text: unknown option.* colour", text, colour=True)


# ---- images -------------------------------------------------------------------------------------

CLASSES = ["cat", "dog", "owl"]  # sorted: labels 0, 1, 2


def write_images(root, count: int, size=(40, 30), seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for k in range(count):
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / c / f"{k:03d}.png")


def test_images_class_folders_split_per_class(tmp_path):
    write_images(tmp_path / "pics", 5)
    train, test = build_datasets("images", dir=str(tmp_path / "pics"), image_size=16, test_fraction=0.4)
    assert train.classes == CLASSES and train.num_classes == 3 and test.classes == CLASSES
    assert (len(train), len(test)) == (9, 6)
    assert train.ids.tolist() == list(range(9)) and test.ids.tolist() == list(range(9, 15))
    assert [train[i][2] for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [test[i][2] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    # each class's last files (in name order) are its test images
    assert [p.split("/")[-1] for p in test.images[:2]] == ["003.png", "004.png"]
    for dataset in (train, test):
        x = dataset[0][1]
        assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    # test items: resized, normalized, never augmented
    with Image.open(test.images[0]) as im:
        resized = np.asarray(im.convert("RGB").resize((16, 16), Image.BILINEAR))
    assert torch.equal(test[0][1], normalize(to_tensor(resized)))
    again, _ = build_datasets("images", data_dir=str(tmp_path), dir="pics", image_size=16, test_fraction=0.4)
    assert again.images == train.images and torch.equal(again.ids, train.ids)
    everything, none = build_datasets("images", dir=str(tmp_path / "pics"), test_fraction=0)
    assert (len(everything), len(none)) == (15, 0)


def test_images_train_test_folders_and_reproducible_augmentation(tmp_path):
    write_images(tmp_path / "train", 3, size=(32, 32))
    write_images(tmp_path / "test", 1, size=(32, 32), seed=1)
    train, test = build_datasets("images", data_dir=str(tmp_path), seed=5)
    assert (len(train), len(test)) == (9, 3) and test.ids.tolist() == [9, 10, 11]
    assert [test[i][2] for i in range(3)] == [0, 1, 2]
    train.set_epoch(2)
    first = train[4]
    assert first[0] == 4 and first[1].shape == (3, 32, 32)
    again, _ = build_datasets("images", data_dir=str(tmp_path), seed=5)
    again.set_epoch(2)
    assert torch.equal(again[4][1], first[1])
    # the same steps as cifar10's transform, drawn from the generator of (seed, epoch, id)
    generator = torch.Generator().manual_seed(mix_seed(5, 2, 4))
    assert torch.equal(first[1], cifar_train_transform(train.image(4), generator))
    changed = []
    for epoch in range(1, 6):
        train.set_epoch(epoch)
        changed.append(not torch.equal(train[4][1], first[1]))
    assert any(changed)
    plain, _ = build_datasets("images", data_dir=str(tmp_path), augment=False, mean=[0, 0, 0], std=[1, 1, 1])
    assert torch.equal(plain[4][1], to_tensor(plain.image(4)))


def test_images_errors_are_one_line(tmp_path):
    write_images(tmp_path / "pics", 2)
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.png")
    (tmp_path / "gap" / "cat").mkdir(parents=True)
    (tmp_path / "gap" / "dog").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "gap" / "cat" / "a.png")
    (tmp_path / "gap" / "dog" / "notes.txt").write_text("no images here")
    write_images(tmp_path / "only" / "train", 1)
    write_images(tmp_path / "mixed" / "train", 1)
    (tmp_path / "mixed" / "test" / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "mixed" / "test" / "cat" / "a.png")
    pics = str(tmp_path / "pics")

    one_line_error("images: dir .*nowhere' does not exist", build_datasets, "images", dir=str(tmp_path / "nowhere"))
    one_line_error("images: dir is required", build_datasets, "images")
    one_line_error("images: .*flat' has no class folders", build_datasets, "images", dir=str(tmp_path / "flat"))
    one_line_error("images: class 'dog' .* has no images", build_datasets, "images", dir=str(tmp_path / "gap"))
    one_line_error("images: test folder", build_datasets, "images", dir=str(tmp_path / "only"))
    one_line_error("images: train classes .* differ", build_datasets, "images", dir=str(tmp_path / "mixed"))
    for bad in (0, -3, 2.5, True):
        one_line_error("images: image_size must be", build_datasets, "images", dir=pics, image_size=bad)
    one_line_error("images: test_fraction must be", build_datasets, "images", dir=pics, test_fraction=1)
    one_line_error("images: mean must be 3 numbers", build_datasets, "images", dir=pics, mean=[0.5])
    one_line_error("images: std must be positive", build_datasets, "images", dir=pics, std=[1, 0, 1])
    one_line_error("images: augment must be", build_datasets, "images", dir=pics, augment="yes")
    one_line_error("images: unknown option", build_datasets, "images", dir=pics, crop=4)


def test_hidden_files_are_left_out_and_a_file_that_is_not_an_image_fails_the_build(tmp_path):
    write_images(tmp_path / "pics", 3)
    (tmp_path / "pics" / "cat" / ".DS_Store.png").write_bytes(b"")  # a desktop's, named like an image
    (tmp_path / "pics" / "dog" / ".thumbnails").mkdir()
    (tmp_path / "pics" / "dog" / ".thumbnails" / "000.png").write_bytes(b"junk")
    train, test = build_datasets("images", dir=str(tmp_path / "pics"), image_size=8, test_fraction=0.34)
    assert len(train) + len(test) == 9
    first = tmp_path / "pics" / "cat" / "000.png"  # a body cut short after the build read its header
    first.write_bytes(first.read_bytes()[:60])
    one_line_error(r"images: .*cat/000\.png is not a readable image", train.__getitem__, 0)
    (tmp_path / "pics" / "dog" / "999.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 8)  # the test split's
    one_line_error(
        r"images: .*dog/999\.png is not a readable image", build_datasets, "images", dir=str(tmp_path / "pics")
    )
    only_hidden = tmp_path / "hidden" / "cat"
    only_hidden.mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(only_hidden / ".a.png")
    one_line_error("images: class 'cat' .* has no images", build_datasets, "images", dir=str(tmp_path / "hidden"))


# ---- config and registry --------------------------------------------------------------------------


def test_config_accepts_the_new_names_and_refuses_others_in_one_line():
    for name in (*DATASETS, "mypkg.data:build", "data:make"):
        assert load_config(None, [f"data.name={name}"]).data.name == name
    cfg = load_config(None, ["data.name=text", "data.options={files: [a.txt], tokenizer: tok, block_size: 8}"])
    assert cfg.data.options["block_size"] == 8
    for bad in ("imagenet", "mypkg.data:", "my pkg:build", "a:b:c"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"data.name='{bad}'"])
        message = str(info.value)
        assert "\n" not in message and message.startswith("data.name: unknown dataset")
        # the config's list of built-in names is the registry's
        assert message.split("choose one of ")[1] == ", ".join(DATASETS) + ", or package.module:function"
    one_line_error("unknown dataset 'imagenet'; choose one of .*text, images", build_datasets, "imagenet")


# ---- a run on a text file -------------------------------------------------------------------------


def test_run_on_a_jsonl_text_file(tmp_path, tok_dir):
    from swarm.training.experiment import run_experiment
    from swarm.training.results import read_results

    write_rows(tmp_path / "corpus.jsonl", ROWS * 4)
    cfg = load_config(
        None,
        [
            "name=text-run",
            "model.name=gpt2",
            "model.num_stages=2",
            "model.options={config: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 260, n_positions: 64}}",
            "data.name=text",
            f"data.data_dir={tmp_path}",
            f"data.options={{files: [corpus.jsonl], tokenizer: '{tok_dir}', block_size: 16}}",
            "optimizer={name: adamw, lr: 0.001, weight_decay: 0.0}",
            "train.batch_size=4",
            "train.micro_batches=2",
            "train.eval_batch_size=8",
            "compression.forward=none",
            "compression.backward=none",
        ],
    )
    run_experiment(cfg, tmp_path / "r.jsonl", max_steps=2, progress=False)
    rows = read_results(tmp_path / "r.jsonl")
    losses = [r["loss"] for r in rows if r["type"] == "step"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    evals = [r for r in rows if r["type"] == "eval"]
    assert evals and math.isfinite(evals[-1]["uncompressed"]["loss"])


def test_the_bytes_tokenizer_needs_no_files_and_reads_utf8_bytes(tmp_path):
    (tmp_path / "t.txt").write_text("héllo wörld\n" * 4, encoding="utf-8")
    train, _ = build_datasets(
        "text", data_dir=str(tmp_path), files=["t.txt"], tokenizer="bytes", block_size=8, test_fraction=0
    )
    assert train.vocab_size == 384  # ByT5's: 256 bytes after 3 special tokens, and its extra ids
    first = train.blocks[0].tolist()
    assert first == [b + 3 for b in "héllo wörld".encode()[:8]]  # é is two bytes
