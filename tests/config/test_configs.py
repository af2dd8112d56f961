"""Every shipped config loads and validates; the paper's tables are all there."""

import pytest
import torch
from _util import REPO

from swarm.config import ConfigError, load_config

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem or path.stem in ("demo", "smoke")


def test_paper_tables_are_covered():
    paper = [load_config(p) for p in CONFIGS if p.parent.name == "paper"]
    by_table: dict[str, list] = {}
    for cfg in paper:
        by_table.setdefault(cfg.report.table.split(":")[0], []).append(cfg)
    assert {k: len(v) for k, v in by_table.items()} == {
        "Table 1": 8,
        "Table 2": 6,
        "Table 3": 5,
        "Table 4": 4,
        "Table 5": 6,
    }
    for cfg in paper:
        assert cfg.report.paper, f"{cfg.name} carries the paper's figures"
        assert cfg.model.num_stages == 4


def test_boundary_overrides_merge_with_the_defaults():
    cfg = load_config(
        None,
        [
            "compression.forward=topk:0.1",
            "compression.backward=topk:reuse",
            "compression.boundaries={1: {forward: 'topk:0.3'}}",
        ],
    )
    assert (cfg.compression.link(0).forward, cfg.compression.link(0).backward) == ("topk:0.1", "topk:reuse")
    assert (cfg.compression.link(1).forward, cfg.compression.link(1).backward) == ("topk:0.3", "topk:reuse")
    with pytest.raises(ConfigError, match="boundaries 0..2, got \\[9\\]"):
        load_config(None, ["compression.boundaries={9: {forward: 'quant:4'}}"])
    with pytest.raises(ConfigError, match="boundary 1.*topk:reuse needs a topk forward"):
        load_config(
            None,
            [
                "compression.forward=topk:0.1",
                "compression.backward=topk:reuse",
                "compression.boundaries={1: {forward: 'quant:4'}}",
            ],
        )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("junk.bin", bytes(range(128, 256)), "junk.bin: not a text file (not UTF-8 at byte 0)"),
        ("empty.yaml", b"", "empty.yaml: the config file is empty (no setting in it)"),
        ("comments.yaml", b"# nothing set yet\n\n", "comments.yaml: the config file is empty (no setting in it)"),
        (".", None, "is a directory"),
    ],
)
def test_a_file_that_is_no_config_fails_in_one_line(tmp_path, capsys, name, content, message):
    from _util import refusal

    if content is not None:
        (tmp_path / name).write_bytes(content)
    assert refusal(capsys, "run", str(tmp_path / name), "--steps", "1").endswith(message)


def test_a_device_this_machine_lacks_fails_in_one_line(capsys):
    from _util import SMOKE, refusal

    missing = f"cuda:{torch.cuda.device_count()}"  # one past this machine's devices, GPU or not
    for device, message in ((missing, f"device {missing}: this machine has "), ("cuda:x", "not a device torch knows")):
        assert message in refusal(capsys, "run", str(SMOKE), "--steps", "1", "--device", device)


def test_a_probation_without_verification_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="verify_probation checks new peers' results: it needs verify > 0") as refused:
        load_config(None, ["train.verify_probation=4"])
    assert "\n" not in str(refused.value)
    assert load_config(None, ["train.verify=0.1", "train.verify_probation=4"]).train.verify_probation == 4
