"""The ranks' ``ctx.state`` files are read as every checkpoint file is: a symlink is not
followed, a FIFO is refused without waiting on it, an oversized header is refused."""

import os

import numpy as np
import pytest

from stalewise.checkpoint import CheckpointError
from stalewise.launch import checkpoints as ck


def test_a_rank_state_round_trips(tmp_path):
    ck.write_rank_state(tmp_path, 0, {"step": 7, "rng": np.arange(3)}, pushes=40, pushed=19)
    got, pushed, skip = ck.read_rank_state(tmp_path, 0)
    assert got["step"] == 7 and got["rng"].tolist() == [0, 1, 2] and (pushed, skip) == (19, 0)
    assert ck.rank_epoch(tmp_path, 0, every=10) == 4
    assert ck.read_rank_state(tmp_path, 1) is None and ck.rank_epoch(tmp_path, 1, 10) == -1


def test_a_symlinked_rank_file_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ck.write_rank_state(elsewhere, 0, {"step": 1}, pushes=40)
    (tmp_path / "rank-0-0.safetensors").symlink_to(elsewhere / "rank-0-0.safetensors")
    with pytest.raises(CheckpointError, match=r"rank-0-0\.safetensors"):
        ck.read_rank_state(tmp_path, 0)
    assert ck.rank_epoch(tmp_path, 0, every=10) == -1


def test_a_fifo_in_place_of_a_rank_file_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "rank-0-0.safetensors")  # an open() would block without a writer
    with pytest.raises(CheckpointError, match="not a regular file"):
        ck.read_rank_state(tmp_path, 0)
    assert ck.rank_epoch(tmp_path, 0, every=10) == -1


def test_a_header_length_past_the_bound_is_refused(tmp_path):
    (tmp_path / "rank-0-0.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    assert ck.rank_epoch(tmp_path, 0, every=10) == -1
    with pytest.raises(CheckpointError, match=r"rank-0-0\.safetensors: not a rank.s state file"):
        ck.read_rank_state(tmp_path, 0)
