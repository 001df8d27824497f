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


def test_only_the_chosen_state_file_is_read_past_its_header(tmp_path):
    """The state of the most pushes is loaded; the other file's header alone is read (a
    body that would not load is not an error), as the launcher does at every checkpoint."""
    ck.write_rank_state(tmp_path, 0, {"rng": np.arange(1000)}, pushes=40, pushed=6)
    ck.write_rank_state(tmp_path, 0, {"step": 7}, pushes=42, pushed=7, skip=1)
    old = tmp_path / "rank-0-0.safetensors"
    old.write_bytes(old.read_bytes()[:-8])  # its tensor's bytes cut short
    assert ck.read_rank_state(tmp_path, 0) == ({"step": 7}, 7, 1)
    assert ck.rank_epoch(tmp_path, 0, every=10) == 4


def test_a_resume_removes_what_is_not_a_rank_state_from_its_folder(tmp_path):
    """``.ranks`` is ours: a stray folder (even holding a symlink out) or file is removed
    on resume, a rank's state kept, what the symlink names untouched."""
    (folder := tmp_path / ".ranks").mkdir(0o700)
    ck.write_rank_state(folder, 0, {"step": 7}, pushes=40, pushed=7)
    (folder / "junk" / "deep").mkdir(parents=True)
    (outside := tmp_path / "outside").write_text("keep")
    (folder / "junk" / "link").symlink_to(outside)
    (folder / "cut").write_text("3")
    with ck.rank_files(str(tmp_path), None, resume=True) as got:
        assert got == folder and sorted(p.name for p in folder.iterdir()) == [
            "rank-0-1.safetensors"
        ]
    assert outside.read_text() == "keep" and ck.read_rank_state(folder, 0)[0] == {"step": 7}
