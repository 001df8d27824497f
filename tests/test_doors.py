"""Every door checks what comes through it (issue #41, items 3-6): checkpoint folders are
trusted as the attach door's folder is, bad input gets one line and no traceback, values
are checked where an API takes them, and the liveness rule says one thing."""

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import child_procs
import numpy as np
import pytest
from test_checkpoint_safety import _rewrite, _sim_train, _two_ckpts

import stalewise as sw
from stalewise import checkpoint
from stalewise.checkpoint import CheckpointError
from stalewise.cli import main
from stalewise.runtime.errors import BudgetSpent

NOBODY = 65534  # another user's uid (the tests run as root, which may chown)

SCRIPT = textwrap.dedent(
    """
    import numpy as np, stalewise as sw

    if __name__ == "__main__":
        job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
        ctx = sw.init(job)
        while not ctx.should_stop():
            ctx.client.pull()
            ctx.client.push({"w": np.ones(3, np.float32)})
        ctx.close()
    """
)


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "stalewise", "run", "--workers", "1", "--steps", "4", *args,
         str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _one_line(stderr: str, *parts: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    for part in parts:
        assert part in lines[0], stderr


# -- item 3: checkpoint folders trusted like the door ---------------------------------------


@pytest.mark.parametrize("how", ["chown", "chmod"])
def test_a_checkpoint_folder_of_another_user_or_that_others_can_write_is_refused(
    tmp_path, caplog, how
):
    d = tmp_path / "ckpt"
    older, newer = _two_ckpts(d)
    if how == "chown":
        os.chown(newer, NOBODY, NOBODY)
    else:
        newer.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert checkpoint.load(d).path == older  # the other one is not used
    want = f"belongs to uid {NOBODY}" if how == "chown" else "writable by others (mode 0777)"
    assert any(want in r.getMessage() and newer.name in r.getMessage() for r in caplog.records)
    older.chmod(0o775)  # the group may write it: refused too, so none is left
    with pytest.raises(CheckpointError, match="no usable checkpoint") as e:
        checkpoint.load(d)
    assert "\n" not in str(e.value)


def test_the_folder_of_checkpoints_and_latest_are_trusted_only_if_ours(tmp_path):
    d = tmp_path / "ckpt"
    older, newer = _two_ckpts(d)
    (d / "latest").write_text(older.name + "\n")  # says the older is the one
    assert checkpoint.load(d).path == older
    os.chown(d / "latest", NOBODY, NOBODY)
    assert checkpoint.load(d).path == newer  # another's latest orders nothing
    d.chmod(0o777)
    with pytest.raises(CheckpointError, match=r"writable by others \(mode 0777\)"):
        checkpoint.load(d)
    d.chmod(0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(CheckpointError, match=f"belongs to uid {NOBODY}"):
        checkpoint.load(d)


def test_checkpoints_are_written_for_the_owner_alone_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a group-writable umask: what save writes must still load
    try:
        _, newer = _two_ckpts(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert checkpoint.load(tmp_path / "ckpt").path == newer
    for path in [tmp_path / "ckpt", newer, *newer.iterdir()]:
        assert not path.stat().st_mode & 0o022, path


def test_train_resuming_from_a_folder_others_can_write_says_so_in_one_line(tmp_path, capsys):
    config = Path(__file__).parent.parent / "examples" / "least_squares.toml"
    run = ["train", str(config), "--runtime", "sim", "-q"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 0
    (tmp_path / "run" / "checkpoints").chmod(0o777)
    capsys.readouterr()
    assert main([*run, "--resume", str(tmp_path / "run")]) == 2
    _one_line(capsys.readouterr().err, "writable by others (mode 0777)")


# -- item 4: one line, not a traceback ------------------------------------------------------


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_run_refuses_a_checkpoint_dir_that_cannot_be_a_folder_in_one_line(tmp_path, capsys, where):
    (tmp_path / "f").write_text("")
    (tmp_path / "train.py").write_text(SCRIPT)
    d = tmp_path / "f" if where == "a-file" else tmp_path / "f" / "sub"
    argv = ["run", "--workers", "1", "--checkpoint-dir", str(d), str(tmp_path / "train.py")]
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, str(d), "not a directory" if where == "a-file" else "")


def test_run_makes_a_checkpoint_dir_whose_parent_is_missing(tmp_path):
    d = tmp_path / "missing" / "ckpt"
    done = _run(tmp_path, "--checkpoint-dir", str(d))
    assert done.returncode == 0, done.stderr
    assert checkpoint.load(d).step["pushes"] >= 4


@pytest.mark.parametrize("every", ["-5", "0", "x"])
@pytest.mark.parametrize("command", ["run", "train"])
def test_checkpoint_every_is_an_integer_of_at_least_one_for_run_and_train(
    tmp_path, capsys, command, every
):
    (tmp_path / "c.toml").write_text("")
    assert main([command, "--checkpoint-every", every, str(tmp_path / "c.toml")]) == 2
    _one_line(capsys.readouterr().err, "--checkpoint-every", "integer >= 1", repr(every))


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_ranks_folder_left_as_a_symlink_or_a_file_is_refused_in_one_line(tmp_path, kind):
    d, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    if kind == "symlink":
        (d / ".ranks").symlink_to(elsewhere)
    else:
        (d / ".ranks").write_text("")
    done = _run(tmp_path, "--checkpoint-dir", str(d))
    assert done.returncode == 2
    _one_line(done.stderr, f"{d / '.ranks'} is a {kind if kind == 'symlink' else 'regular file'}")
    assert (elsewhere / "keep").read_text() == "mine"  # nothing emptied through the link


def test_a_checkpoint_dir_others_can_write_is_refused_before_the_run(tmp_path, capsys):
    d = tmp_path / "ckpt"
    d.mkdir(0o777)
    d.chmod(0o777)
    (tmp_path / "train.py").write_text(SCRIPT)
    assert main(["run", "--checkpoint-dir", str(d), str(tmp_path / "train.py")]) == 2
    _one_line(capsys.readouterr().err, str(d), "writable by others")


def test_a_resealed_shard_state_with_an_unknown_key_falls_back(tmp_path, caplog):
    d = tmp_path / "ckpt"
    older, newer = _two_ckpts(d)
    _rewrite(newer, lambda m: m["shards"][0]["values"].update(bogus=1))
    with caplog.at_level(logging.WARNING):
        result = _sim_train(d, steps=30, every=10, resume=True)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'bogus': unknown key" in said and f"using {older.name} instead" in said, said
    assert result.pushes == 30


def test_a_rank_state_list_of_another_length_falls_back(tmp_path, caplog):
    def serve():
        job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.5))
        return job.serve(workers=2, checkpoints=sw.Checkpoints(tmp_path, every=1000, resume=True))

    for _ in range(2):  # two checkpoints, each with the two ranks' (empty) states
        with serve() as server:
            server.client(0).push({"w": np.ones(3, np.float32)})
            server.client(0).wait()
    _, newer = sorted(tmp_path.glob("ckpt-*"))
    _rewrite(newer, lambda m: m["ranks"]["values"].pop())
    with caplog.at_level(logging.WARNING), serve() as server:
        assert server.stats()[0]["version"] == 2  # the older one and its logs' push
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "ctx.state of 1 ranks, not 2" in said, said
    # the resumed job's first checkpoint, of the same pushes, took the refused one's place
    assert json.loads((newer / "manifest.json").read_text())["ranks"]["values"] == [{}, {}]


STARTER = textwrap.dedent(
    """
    import os, subprocess, sys
    from multiprocessing import spawn
    from stalewise.runtime.local import procs

    r, w = os.pipe()  # the child reads its start from r; nothing is ever written to w
    with procs.stalewise_main():
        cmd = spawn.get_command_line(pipe_handle=r)
    child = subprocess.Popen(cmd, pass_fds=[r])
    if sys.argv[1] == "dies":
        os._exit(0)  # killed while it starts the child: w closes with this process
    os.close(w)
    child.wait()
    """
)


@pytest.mark.parametrize("parent", ["dies", "lives"])
def test_a_child_whose_parent_dies_while_starting_it_exits_quietly(tmp_path, parent):
    (tmp_path / "starter.py").write_text(STARTER)
    done = subprocess.run([sys.executable, str(tmp_path / "starter.py"), parent],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    # the child holds stderr until it ends: run() returning means it ended, in time
    if parent == "dies":
        assert done.stderr == "", done.stderr
    else:  # a parent still there hears what went wrong, as before
        assert "EOFError" in done.stderr, done.stderr


def test_a_released_client_used_in_the_serving_process_says_it_was_handed_on():
    with _served(workers=2) as server:
        client = server.client(0)
        server.release(0)
        for use in (client.pull, lambda: client.push({"w": np.ones(3, np.float32)})):
            with pytest.raises(RuntimeError, match=r"server\.release\(0\) hands it to the proc"):
                use()
        closed = server.client(1)
        closed.close()
        with pytest.raises(sw.ServerClosed, match="this client is closed"):
            closed.pull()


# -- item 5: values checked at the door of every API ------------------------------------------


def _served(**kwargs):
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.5))
    return job.serve(**kwargs)


def test_client_budget_takes_none_or_an_integer_of_at_least_one():
    with _served(workers=1) as server:
        client = server.client(0)
        for bad in (-1, 0, 1.5, True, "10", float("nan"), 10**30, np.int64(10)):
            with pytest.raises(ValueError, match=r"client\.budget must be None or an integer") as e:
                client.budget = bad
            assert repr(bad) in str(e.value) and client.budget is None
        client.budget = 2
        client.push({"w": np.ones(3, np.float32)})
        client.push({"w": np.ones(3, np.float32)})
        with pytest.raises(BudgetSpent):
            client.push({"w": np.ones(3, np.float32)})
        client.budget = None
        client.close()


def test_the_attach_door_refuses_a_worker_that_is_not_an_integer():
    name = f"doors-{uuid.uuid4().hex[:8]}"
    with _served(workers=(0, 2), name=name) as server:
        for bad in (True, 1.0, "1", [1]):
            with pytest.raises(sw.AttachError, match="unknown worker") as e:
                sw.attach(name, worker=bad, timeout=30)
            assert "\n" not in str(e.value)
        assert server.attached() == set()
        client = sw.attach(name, worker=1, timeout=30)
        assert client.worker == 1
        client.close()


# -- item 6: one rule for a silent rank, one line for a first --resume -------------------------

BSP_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np, stalewise as sw

    if __name__ == "__main__":
        job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1),
                     consistency=sw.BSP())
        ctx = sw.init(job)
        pushes = 0
        while not ctx.should_stop():
            ctx.client.pull(timeout=120)
            time.sleep(0.5)  # a step's work: the launcher sees each push on its own
            ctx.client.push({"w": np.ones(3, np.float32)})
            pushes += 1
            if ctx.rank == 1 and pushes == 3:  # a long evaluation, or a hang
                time.sleep(6 if sys.argv[1] == "pause" else 3600)
        ctx.close()
    """
)


BSP_TIMEOUT = {"pause": 40, "hang": 10}  # a hang waits it out: silent 2-4x --rank-timeout


@pytest.fixture(scope="module")
def bsp_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """BSP_SCRIPT launched for each of BSP_TIMEOUT's ways, the two at once (they mostly
    sleep), each in a folder and a session of its own: killed whole when this ends or
    after 240 s."""
    procs = {}
    with contextlib.ExitStack() as stack:
        for how, timeout in BSP_TIMEOUT.items():
            folder = tmp_path_factory.mktemp(f"bsp-{how}")
            (folder / "bsp.py").write_text(BSP_SCRIPT)
            flags = ["--workers", "2", "--steps", "10", "--rank-timeout", "2", "--timeout"]
            argv = [sys.executable, "-m", "stalewise", "run", *flags, str(timeout), "bsp.py", how]
            pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs[how] = stack.enter_context(child_procs.session(argv, folder, **pipes))
        deadline = time.monotonic() + 240
        outs = {how: p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                for how, p in procs.items()}  # fmt: skip
    return {
        how: subprocess.CompletedProcess(p.args, p.returncode, *outs[how])
        for how, p in procs.items()
    }


@pytest.mark.parametrize("how", list(BSP_TIMEOUT))
def test_a_bsp_rank_that_stops_is_left_to_the_timeout_not_killed_as_hung(bsp_runs, how):
    """Under BSP the other rank waits on the silent one: the job does not go on without
    it, so --rank-timeout does not judge it. A pause ends and the run completes; a hang is
    caught by --timeout, which names the rank."""
    done, timeout = bsp_runs[how], BSP_TIMEOUT[how]
    assert "hung" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    if how == "pause":
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 1, done.stderr
        timed_out = f"timed out after {timeout} s (--timeout): still running: rank 0 ("
        assert timed_out in done.stderr and "; rank 1 (3 pushes, the last" in done.stderr


def test_a_first_resume_says_once_that_there_is_no_checkpoint_yet(tmp_path):
    done = _run(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("no checkpoint in") == 1, done.stderr


# -- issue 43 item 3: one tree-to-JSON codec for checkpoints and the attach door ---------------


def test_the_live_codec_carries_a_tree_to_another_process_of_the_job_whole():
    from collections import OrderedDict

    from test_checkpoint_safety import Conf, Pair

    from stalewise import tree
    from stalewise.checkpoint.spec import NotData, spec_from_json, spec_to_json

    w = np.arange(4, dtype=np.float32)
    params = OrderedDict(
        pair=Pair(w, np.zeros(2, np.float32)),
        conf=Conf(np.ones(3, np.float32), name="kept"),
        rows=[w, {("a", 1): np.full(2, 7.0, np.float32)}],  # a tied leaf, a tuple key
    )
    flat, spec = tree.flatten(params)
    sent = json.loads(json.dumps(spec_to_json(spec, live=True)))
    back = tree.unflatten(flat, spec_from_json(sent, live=True))
    assert type(back) is OrderedDict and sorted(back) == sorted(params)
    assert type(back["pair"]) is Pair and type(back["conf"]) is Conf
    assert back["conf"].name == "kept"  # a static field
    assert list(back["rows"][1]) == [("a", 1)]
    np.testing.assert_array_equal(back["rows"][0], w)
    saved = spec_from_json(json.loads(json.dumps(spec_to_json(spec))))  # a checkpoint's
    plain = tree.unflatten(flat, saved)
    assert type(plain["pair"]) is dict and type(plain["conf"]) is dict
    sent["tree"]["children"][0]["type"] = ["os", "system"]
    with pytest.raises(
        NotData, match=r"a dataclass of class os\.system, which this process has not imported"
    ):
        spec_from_json(sent, live=True)


def test_a_door_whose_stalewise_lays_the_block_out_otherwise_is_refused_in_one_line():
    """An attaching process of another stalewise version would read the wrong bytes."""
    from stalewise.runtime.local import door_state

    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with job.serve(workers=1) as server:
        client = server.client(0)
        doc = json.loads(door_state.encode(server.config, client, 1))
        assert door_state.decode(json.dumps(doc).encode())[0] is None  # the same stalewise
        doc["client"]["where"][0] += 4096  # as a version with another page offset would
        refusal, plan = door_state.decode(json.dumps(doc).encode())
        client.close()
    assert plan is None and "\n" not in refusal
    assert refusal.startswith("its shared memory is laid out as another stalewise does")
