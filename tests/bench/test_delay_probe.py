"""The plain-PyTorch delay probe (swarm.bench.delay_probe) behind docs/bench/time-to-target.md's
account of what one step of delay costs."""

import argparse
import random

import pytest

from swarm.bench import delay_probe


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A text of its own (the probe's default is the shared WikiText-2 file): 300 blocks of bytes."""
    words = ["pipeline", "stage", "swarm", "gradient", "delay", "weights", "the", "a", "of", "runs"]
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("probe") / "text.raw"
    path.write_text(" ".join(rng.choice(words) for _ in range(300 * 64 // 6)), encoding="utf-8")
    return str(path)


def _args(text: str, **changes) -> argparse.Namespace:
    args = dict(delay=1, sync_steps=0, optimizer="adamw", lr=0.002, beta1=0.9, beta2=0.999, eps=1e-8)
    args.update(grad_clip=1.0, lookahead=False, steps=4, every=1, seed=0, threads=1, text=text)
    return argparse.Namespace(**{**args, **changes})


def test_a_delay_changes_the_losses_and_synchronous_steps_are_steps_without_delay(text):
    in_step = delay_probe.run(_args(text, delay=0))
    late = delay_probe.run(_args(text, delay=1))
    all_synchronous = delay_probe.run(_args(text, delay=1, sync_steps=4))
    assert all_synchronous == in_step  # --sync_steps covers the whole run: no step is late
    # one step late: after 2 steps the late run has applied the first step's gradient, at the
    # same weights, so it is where the in-step run was after 1; the next gradients differ
    assert late[1][1] == in_step[0][1] and late[0][1] != in_step[0][1]
    assert late[2][1] != in_step[1][1]
    # the look-ahead computes step 3's gradient at predicted weights, applied at step 4
    ahead = delay_probe.run(_args(text, delay=1, lookahead=True))
    assert ahead[:3] == late[:3] and ahead[3][1] != late[3][1]


def test_bad_arguments_get_one_line(capsys):
    with pytest.raises(SystemExit):
        delay_probe.main(["--delay", "-1"])
    assert "--delay and --sync_steps must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        delay_probe.main(["--text", "/nonexistent/wiki.test.raw"])
    assert "no such file" in capsys.readouterr().err
