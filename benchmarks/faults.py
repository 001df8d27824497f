"""Faults on the local runtime: what survives, what is lost, how fast the job recovers.

The digits MLP on 4 local workers (10 ms of emulated compute per step), 2 shards,
SGD with momentum, under ASP and under BSP. Each consistency model runs once
undisturbed, then once per fault, with the same budget of pushes:

  (a) worker-kills  a random worker SIGKILLed every 5 s (restart policy);
  (b) shard-kill    shard 1 SIGKILLed once, 40% into the run (checkpoints every 500
                    updates, so the restarted shard gets its momentum from the last one);
  (c) worker-stop   one worker SIGSTOPped for 10 s (worker_timeout 3 s: it is found
                    hung, killed and restarted);
  (d) bad-pushes    worker 3 pushes NaN 10 times, then 1e38 from then on;
  (e) ckpt-full     checkpoints every 250 pushes, all kept, into a real tmpfs of
                    room for about three of them: the folder fills up mid-run, and
                    the final checkpoint cannot be written either.
  (f) shard-kills   ``--shard-kills N`` runs only this case: N SIGKILLs in all, a
                    random shard at a random record (every 0.25 s) once the job
                    has made 20 to 120 pushes since the last (so its workers are
                    back), up to KILLS_PER_RUN to a run, checkpoints every 500 pushes
                    into a folder (so each shard keeps a push log and is rebuilt
                    from it). Columns: ``acked_lost`` (pushes the workers counted
                    that a shard lacks: a counted push is one acknowledged or about
                    to be), ``applied_twice`` (pushes a shard handled twice by
                    worker, incarnation and seq, its log chain replayed from the
                    first checkpoint), ``torn`` (the shards' handled pushes
                    differ), ``replay_eq`` (the first checkpoint and the logs
                    replay to the final params bit for bit), ``shard_s`` (from the
                    kill to the shard serving again) and ``recover_s`` (to every
                    running worker handed its pipe to it, or the last restarted
                    worker back in the run).
  (f2) replica-kills ``--replica-kills N``: (f) with ``replicas=2``, each kill a random
                    primary (its pause: ``shard_s``, ``recover_s``) or backup (about half
                    each), once every shard has a backup linked again (single failures);
                    ``sources``: where each restarted primary's state came from;
                    ``pause_backup_s``: from a backup's kill to the record (every
                    0.05 s) at which the job has made more than WORKERS more pushes (one in
                    flight per worker: so some push was acknowledged).
  (g) launcher-kills ``--launcher-kills N`` runs only this case: the one-hot job of
                    ``tests/test_one_cut.py`` (``stalewise run``, 2 ranks, rank r's i-th
                    push adds 1 to item (r, i), a checkpoint every 50 pushes), its
                    launcher SIGKILLed N times at a random moment (0 to 1.5 s after
                    its first push), each followed by ``--resume``, ASP and BSP in
                    turn, then run to its end. Columns: ``acked_lost`` (pushes a rank
                    saw acknowledged that the resumed shards lack), ``twice`` and
                    ``skipped`` (items of the final parameters applied twice or not at
                    all), ``replayed`` (pushes the resumes took from the push logs),
                    ``rank_skips`` (pushes the ranks skipped, in the shards already),
                    ``first_push_s`` (from starting the resumed launcher to its first
                    acknowledged push; ``fresh_s`` for the first start).
  (h) parent-kills  ``--parent-kills N`` runs only this case: the one-hot ``Job.train``
                    job of ``tests/test_parent_kill_resume.py`` (2 workers, 2 shards,
                    worker w's i-th batch adds 1 to item (w, i), a checkpoint every 50
                    pushes), its parent SIGKILLed N times (its shards and workers die
                    with it) once a worker has begun 30 to 120 batches more than before
                    the last kill, then 0 to 0.3 s (seeded, the seed printed), each
                    followed by a resume (``sw.Checkpoints(resume=True)``), ASP and BSP
                    in turn, then run to its end. Columns as (g), except ``acked_lost``
                    (pushes acknowledged before a kill, every batch up to two before
                    the last one begun, that the resumed state lacks) and ``ready_s``
                    (from the relaunch to the first batch begun; ``fresh_s``: the first
                    start's).
  (i) serve-kills   ``--serve-kills N`` runs only this case: a one-hot job served by
                    ``job.serve(workers=2, name=..., checkpoints=sw.Checkpoints(dir,
                    every=50, resume=...))`` in a child process, 2 shards, 2 worker
                    processes attached by name, each pushing item ``client.pushed``
                    (its pushes the shards hold) next, 6,000 pushes; the serving
                    process SIGKILLed N times (its workers fail and are killed) once a
                    worker has 20-120 more pushes acknowledged than at the run's start
                    (then 0-0.3 s; seeded), each followed by serving it again with
                    resume and new workers, ASP and BSP in turn, then run to its end.
                    Columns as (g); ``first_push_s`` from the relaunch of the serving
                    process to the first push acknowledged.
  ``--replicas 2`` runs (g), (h) or (i) with a backup process per shard.
  (j) ray-replica-kills ``--ray-replica-kills N`` runs only this case: least-squares
                    (n=256, d=16) on Ray (a local instance of one node, so each backup
                    shares its primary's node), 4 workers, 2 shards, ``replicas=2``,
                    ASP, SGD, no limit on restarts; N SIGKILLs of a random primary or
                    backup shard actor (in turn, seeded), each once 100 more pushes since the
                    last. Columns: ``acked_lost`` and ``twice`` (per shard, pushes the
                    workers saw applied that it lacks, or that it applied beyond them),
                    ``rolled_back`` (shard restarts not served from a backup),
                    ``backups`` (each backup's final state equal to its primary's),
                    ``primary_s`` and ``backup_s`` (the mean pause after a kill of each
                    kind: until more than 4 pushes follow it), ``replay_eq`` (a
                    checkpoint folder, checkpoints every 500 pushes: the checkpoint
                    before any push (``from_pushes``) and the shards' push logs replay to
                    the final params bit for bit; ``logs``: the log files replayed;
                    ``log_twice``: pushes a shard's log has it apply twice, as (f)).

Columns: ``completed`` (the run returned, with its budget spent: ``steps`` pushes
under ASP, ``ceil(steps / workers)`` whole rounds under BSP, so a BSP run in which a
worker missed rounds makes fewer pushes) or the error;
``pushes`` (counted by the workers); ``lost`` (pushes no shard handled, plus the
updates a restarted shard's slice lacks); ``dups`` (replays the shards caught and
did not apply; a push applied twice would show as handled > pushed + kills,
``twice``); the final held-out ``accuracy`` and its difference from the
undisturbed run in points; ``detect_s`` and ``recover_s`` (from the fault to the
runtime noticing it, and to the replacement process being back in the run; mean
over the faults of the run); ``refused`` (pushes refused, by kind); ``events``.

(e) needs root (it mounts the tmpfs, and unmounts it); without it the case says
so and is left out of the bar. Its ``events`` column counts the checkpoints
that could not be written, and ``kept`` names the newest one that was (it
must load).

Bar: (f) 0 lost, 0 twice, 0 torn, every replay equal. (g), (h), (i) 0 lost, 0 twice, 0 skipped.
(j) 0 lost, 0 twice, no rollback, every backup equal to its primary, replay equal. (a), (b) and (c) complete with nothing applied twice and a final accuracy
within 1 point of the undisturbed run; (e) completes, returns its result within
1 point of the undisturbed run, and its kept checkpoint loads. (d) is reported
as it happens. ``--check``
also writes the table to ``runs/bench-faults.json`` (or ``--json PATH``).

    .venv/bin/python benchmarks/faults.py [--quick] [--check] [--json PATH] [--shard-kills N]
        [--launcher-kills N] [--parent-kills N] [--serve-kills N] [--ray-replica-kills N]
        [--replicas 2]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import math
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import _report
import numpy as np

import stalewise as sw
from stalewise import checkpoint, tasks
from stalewise.report import format_table

WORKERS, SHARDS, DELAY = 4, 2, 0.010
KILLS_PER_RUN = 10
BAD_WORKER, BAD_FROM, NAN_PUSHES = 3, 50, 10


class Tagged:
    """``task.batches`` with each batch tagged ``((worker, index), batch)``."""

    def __init__(self, task):
        self.task = task

    def __call__(self, worker, workers):
        for i, batch in enumerate(self.task.batches(worker, workers)):
            yield (worker, i), batch


class BadPushes:
    """The task's ``loss_and_grad``, except worker 3 from its batch 50: NaN 10 times, then 1e38."""

    def __init__(self, task):
        self.task = task

    def __call__(self, params, tagged):
        (worker, i), batch = tagged
        loss, grads = self.task.loss_and_grad(params, batch)
        if worker == BAD_WORKER and i >= BAD_FROM:
            value = np.nan if i < BAD_FROM + NAN_PUSHES else 1e38
            grads = {
                k: {n: np.full_like(a, value) for n, a in leaf.items()} for k, leaf in grads.items()
            }
        return loss, grads


class Plain:
    """The task's ``loss_and_grad`` on tagged batches."""

    def __init__(self, task):
        self.task = task

    def __call__(self, params, tagged):
        return self.task.loss_and_grad(params, tagged[1])


class Faults:
    """An ``on_record`` that injects one case's faults into the running job, and times them."""

    def __init__(self, case, expected: float, every: float, stop_for: float, seed=0, kills=0):
        self.case, self.expected, self.every, self.stop_for = case, expected, every, stop_for
        self.rng = random.Random(seed)
        self.kills = kills  # shard-kills: how many are left
        self.t0 = None
        self.at: list[float] = []  # run time of each fault
        self.stopped: int | None = None  # pid of the stopped worker
        self.next = every if case == "worker-kills" else 0.4 * expected
        # shard-kills: the next kill once the run has made this many pushes
        self.after = self.rng.randint(20, 120) if case.endswith("-kills") else 0
        self.pauses: list = []  # replica-kills: seconds after each backup's kill
        self.linked: set[int] = set()  # replica-kills: backups linked to their primary
        self.waiting: list = []  # (time, pushes) of backup kills whose pause is not over
        self.backup_at: set = set()  # times of backup kills (no failure event: not timed)

    def _children(self, kind: str) -> list:
        return sorted(
            (p for p in mp.active_children() if p.name.startswith(f"stalewise-{kind}-")),
            key=lambda p: p.name,
        )

    def __call__(self, rec: dict) -> None:
        now = rec["time"]
        for w in [w for w in self.waiting if rec["pushes"] > w[1] + WORKERS]:  # an ack came
            self.pauses.append(now - w[0])
            self.waiting.remove(w)
        if self.stopped is not None and now >= self.at[-1] + self.stop_for:
            with contextlib.suppress(ProcessLookupError):  # unless the runtime killed it
                os.kill(self.stopped, signal.SIGCONT)
            self.stopped = None
        if self.next is None or now < self.next or rec["pushes"] < self.after:
            return
        if self.case == "worker-kills":
            victim = self.rng.choice(self._children("worker"))
            os.kill(victim.pid, signal.SIGKILL)
            self.next = now + self.every
        elif self.case == "shard-kill":
            os.kill(self._children("shard")[1].pid, signal.SIGKILL)
            self.next = None
        elif self.case[0] == "r" and not self._backed():  # one failure at a time: wait
            self.after = rec["pushes"] + self.rng.randint(20, 120)  # for the new backup
            return
        elif self.case.endswith("-kills"):  # this record comes after the last recovery
            kind = self.rng.choice(("shard", "backup")) if self.case[0] == "r" else "shard"
            os.kill(self.rng.choice(self._children(kind)).pid, signal.SIGKILL)
            if kind == "backup":  # a primary's pause: shard_s, recover_s
                self.waiting.append((now, rec["pushes"]))
                self.backup_at.add(now)
            self.kills -= 1
            self.after = rec["pushes"] + self.rng.randint(20, 120)  # the workers are back
            self.next = now if self.kills else None
        elif self.case == "worker-stop":
            self.stopped = self._children("worker")[1].pid
            os.kill(self.stopped, signal.SIGSTOP)
            self.next = None
        else:
            self.next = None
            return
        self.at.append(now)

    def _backed(self) -> bool:
        """Whether every shard has a backup linked to its primary (the server's log line)."""
        backups = self._children("backup")
        return len(backups) == SHARDS and all(p.pid in self.linked for p in backups)

    def emit(self, record: logging.LogRecord) -> None:  # a logging handler's: a link
        if record.msg == "shard %d: backup %d linked":
            self.linked.add(record.args[1])

    def timings(self, failures: list[dict]) -> tuple[float, float]:
        """Mean seconds from each fault to its detection, and to the recovery."""
        detect, recover = [], []
        for t in [t for t in self.at if t not in self.backup_at]:  # else: the next primary's
            later = [e for e in failures if e["time"] >= t and e["action"] != "diverged"]
            if later:
                detect.append(later[0]["time"] - t)
                if "recovered" in later[0]:
                    recover.append(later[0]["recovered"] - t)
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        return mean(detect), mean(recover)


def run(
    task,
    consistency,
    case: str,
    steps: int,
    expected: float,
    quick: bool,
    seed=0,
    kills=0,
    **kwargs,
) -> dict:
    every, stop_for, timeout = (2.5, 4.0, 1.5) if quick else (5.0, 10.0, 3.0)
    faults = Faults(case, expected, every, stop_for, seed, kills)
    job = sw.Job(
        task.init_params(0),
        optimizer=sw.optim.sgd(0.05, momentum=0.9),
        consistency=consistency,
        shards=SHARDS,
        replicas=2 if case == "replica-kills" else 1,
    )
    checkpoints, failures = None, sw.Failures(max_restarts=None)
    if case == "shard-kill":
        checkpoints = sw.Checkpoints(tempfile.mkdtemp(prefix="faults-"), every=500)
    if case == "worker-stop":
        failures = sw.Failures(max_restarts=None, worker_timeout=timeout)
    if case == "ckpt-full":
        checkpoints = sw.Checkpoints(kwargs["ckpt_dir"], every=250, keep=10**6)
    if case.endswith("-kills"):
        checkpoints = sw.Checkpoints(tempfile.mkdtemp(prefix="faults-"), every=500, keep=10**6)
    loss = BadPushes(task) if case == "bad-pushes" else Plain(task)
    row: dict = {"case": case, "consistency": str(consistency)}
    t = time.perf_counter()
    links = logging.getLogger("stalewise.runtime.local.server")
    handler = logging.Handler(logging.INFO)
    handler.emit = faults.emit
    links.addHandler(handler)
    links.setLevel(min(links.getEffectiveLevel(), logging.INFO))
    try:
        with warnings.catch_warnings():  # the failures are in r.failures, and in the table
            warnings.simplefilter("ignore", sw.FailureWarning)
            r = job.train(
                loss,
                data=Tagged(task),
                workers=WORKERS,
                steps=steps,
                evaluate=task.evaluate,
                metrics=sw.Metrics(
                    every=0.05 if case == "replica-kills" else 0.25, on_record=faults
                ),
                emulation=sw.Emulation(delays=dict.fromkeys(range(WORKERS), DELAY)),
                failures=failures,
                checkpoints=checkpoints,
                timeouts=sw.Timeouts(total=600),
            )
    except (sw.WorkerError, RuntimeError, TimeoutError) as e:
        first = str(e).splitlines()[0]
        return row | {
            "completed": f"no: {type(e).__name__}: {first[:60]}",
            "time_s": time.perf_counter() - t,
        }
    finally:
        links.removeHandler(handler)
    s = r.stats
    refused = sum(s["rejected"].values())
    handled = s["applied"] + refused
    lost_slice = sum(e.get("lost") or 0 for e in r.failures if "shard" in e)
    detect, recover = faults.timings(r.failures)
    # a worker killed between committing a push and counting it: handled, not counted
    killed = sum("worker" in e for e in r.failures) + WORKERS * sum(
        "shard" in e for e in r.failures
    )
    if case.endswith("-kills"):
        row |= _logged(job, r, checkpoints.dir, len(faults.at), killed)
        row["pause_backup_s"] = faults.pauses
        if case == "replica-kills":  # each restart's source: a replay fallback shows here
            row["sources"] = dict(
                collections.Counter(e["source"] for e in r.failures if "source" in e)
            )
        shutil.rmtree(checkpoints.dir, ignore_errors=True)
    return row | {
        # the run's own end reason: under BSP its budget is whole rounds, so a run whose
        # worker missed rounds (dead, restarting, dropped) ends with fewer pushes than steps
        "completed": "yes" if r.ended == "budget" else f"no: {r.stop_reason}",
        "time_s": r.time,
        "pushes": r.pushes,
        "lost": max(0, r.pushes - handled) + lost_slice,
        "dups": s["duplicates"],
        "twice": max(0, handled - r.pushes - killed),
        "accuracy": r.records[-1]["accuracy"],
        "detect_s": detect,
        "recover_s": recover,
        "refused": ", ".join(f"{k} {n}" for k, n in sorted(s["rejected"].items())) or "-",
        "events": _events(r.failures),
        "kept": _kept(checkpoints.dir) if case == "ckpt-full" else "",
    }


def _logged(job, r, folder: str, kills: int, killed: int) -> dict:
    """What each shard handled (the final checkpoint's counters) against the pushes the
    workers counted, the pushes a shard's log has it apply twice (by worker, incarnation
    and seq), and whether the first checkpoint and the logs replay to the end."""
    from stalewise.checkpoint import replay, store

    states = store.load(folder).states
    handled = [s["stats.applied"] + sum(s["stats.rejected"].values()) for s in states]
    first = min(p.name for p in store._complete(Path(folder)))
    flat, ckpt, _ = replay.replay(folder, job.config, first)
    serving = [e["serving"] - e["time"] for e in r.failures if "serving" in e]
    return {
        "kills": kills,
        "shard_s": sum(serving) / len(serving) if serving else math.nan,
        "acked_lost": max(0, r.pushes - min(handled)),
        "torn": max(handled) - min(handled),
        "applied_twice": sum(_twice(job, ckpt, k, Path(folder)) for k in range(len(ckpt.states))),
        "replay_eq": flat.tobytes() == r.flat.tobytes(),
    }


def _twice(job, ckpt, k: int, folder: Path) -> int:
    """Pushes shard ``k`` handled more than once by ``(worker, incarnation, seq)``: its log
    chain from ``ckpt`` replayed one entry at a time."""
    from stalewise.checkpoint import replay
    from stalewise.protocol import Ack, pushlog

    state = ckpt.states[k]
    shard = job.config.build_shard(k, np.array(state["params"]), WORKERS)
    shard.load_state_dict(state)
    seen: collections.Counter = collections.Counter()
    for _, f, where, last in replay._chain(folder, ckpt.step["logs"][k]):
        with f:
            for entry in replay._read(f, shard.params.nbytes, where, last):
                ack = pushlog.replay(shard, [entry], where)[0]
                if isinstance(ack, Ack) and not ack.duplicate and ack.seq is not None:
                    seen[(ack.worker, int(shard.incarnation[ack.worker]), ack.seq)] += 1
    return sum(n - 1 for n in seen.values())


def _events(failures: list[dict]) -> str:
    """The failure events in a few words: ``w1 restarted``, ``s1 restarted``, and the
    count of checkpoints that could not be written (the last one's cause)."""
    ckpt = [e for e in failures if "checkpoint" in e]
    words = [
        f"{'w' if 'worker' in e else 's'}{e.get('worker', e.get('shard'))} {e['action']}"
        for e in failures
        if "checkpoint" not in e
    ]
    if ckpt:
        final = " (the final one too)" if ckpt[-1]["final"] else ""
        words.append(f"{len(ckpt)} checkpoints not written{final}: {ckpt[-1]['cause'][:40]}")
    return ", ".join(words) or "-"


def _kept(directory: str | None) -> str:
    """The newest checkpoint in ``directory`` that loads (its folder's name), or why none."""
    try:
        return checkpoint.load(directory).path.name
    except (sw.CheckpointError, OSError) as e:
        return f"none: {str(e)[:40]}"


def checkpoint_size(task) -> int:
    """Bytes of one checkpoint of the benchmark's job, measured by writing one."""
    config = sw.Job(
        task.init_params(0), optimizer=sw.optim.sgd(0.05, momentum=0.9), shards=SHARDS
    ).config
    states = [
        config.build_shard(k, config.init[lo:hi].copy(), workers=WORKERS).state_dict()
        for k, (lo, hi) in enumerate(config.ranges)
    ]
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint.save(
            d, states, spec=config.spec, config_info=checkpoint.config_info(config),
            step_info={"pushes": 0, "time": 0.0},
        )  # fmt: skip
        return sum(f.stat().st_size for f in path.iterdir())


@contextlib.contextmanager
def small_tmpfs(nbytes: int):
    """A real tmpfs of ``nbytes`` (rounded up to pages), mounted on a fresh folder;
    yields that folder, or None with the reason printed when it cannot be mounted."""
    where = Path(tempfile.mkdtemp(prefix="faults-tmpfs-"))
    size = -(-nbytes // 4096) * 4096
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"(e) ckpt-full: cannot mount a tmpfs ({why[0]}); the case is left out")
        shutil.rmtree(where, ignore_errors=True)
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="shorter runs and faults (~1/3 of the time)"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if the bar is missed")
    ap.add_argument("--shard-kills", type=int, metavar="N", help="only case (f), N kills")
    ap.add_argument("--replica-kills", type=int, metavar="N", help="only case (f2), N kills")
    ap.add_argument("--launcher-kills", type=int, metavar="N", help="only case (g), N kills")
    ap.add_argument("--parent-kills", type=int, metavar="N", help="only case (h), N kills")
    ap.add_argument("--serve-kills", type=int, metavar="N", help="only case (i), N kills")
    ap.add_argument("--ray-replica-kills", type=int, metavar="N", help="only case (j)")
    ap.add_argument("--replicas", type=int, choices=(1, 2), default=1, help="(g), (h), (i)")
    _report.add_json_arg(ap)
    args = ap.parse_args()
    out = _report.json_path(ap, args, "faults")
    logging.basicConfig(level=logging.ERROR)  # the runtime's warnings would flood the table
    if args.launcher_kills:
        return launcher_kills(args.launcher_kills, out, args.check, args.replicas)
    if args.parent_kills:
        return parent_kills(args.parent_kills, out, args.check, args.replicas)
    if args.serve_kills:
        return serve_kills(args.serve_kills, out, args.check, args.replicas)
    if args.ray_replica_kills:
        return ray_replica_kills(args.ray_replica_kills, out, args.check)
    task = tasks.get("digits")
    steps = 1500 if args.quick else 4000
    if args.shard_kills or args.replica_kills:
        case = "shard-kills" if args.shard_kills else "replica-kills"
        n = args.shard_kills or args.replica_kills
        return shard_kills(task, n, steps, args.quick, out, args.check, case)
    rows = []
    ckpt_bytes = checkpoint_size(task)
    for consistency in (sw.ASP(), sw.BSP()):
        base = run(task, consistency, "undisturbed", steps, 0.0, args.quick)
        ran = [base]
        for case in ("worker-kills", "shard-kill", "worker-stop", "bad-pushes"):
            ran.append(run(task, consistency, case, steps, base["time_s"], args.quick))
        with small_tmpfs(int(3.5 * ckpt_bytes)) as where:
            if where is not None:
                kw = {"ckpt_dir": str(where / "ckpt")}
                ran.append(run(task, consistency, "ckpt-full", steps, 0.0, args.quick, **kw))
        for row in ran:
            row["d_acc_pts"] = 100 * (row.get("accuracy", math.nan) - base["accuracy"])
        rows += ran
    cols = ["case", "consistency", "completed", "time_s", "pushes", "lost", "dups", "twice",
            "accuracy", "d_acc_pts", "detect_s", "recover_s", "refused", "kept",
            "events"]  # fmt: skip
    print(f"digits MLP, {WORKERS} workers, {SHARDS} shards, {steps} pushes per run")
    print(format_table(rows, cols))
    bar = [r for r in rows if r["case"] in ("worker-kills", "shard-kill", "worker-stop")]
    ok = all(
        r["completed"] == "yes" and r["twice"] == 0 and abs(r["d_acc_pts"]) <= 1.0 for r in bar
    )
    full = [r for r in rows if r["case"] == "ckpt-full"]
    full_ok = all(
        r["completed"] == "yes"
        and abs(r["d_acc_pts"]) <= 1.0
        and r["kept"].startswith("ckpt-")
        and "not written" in r["events"]
        for r in full
    )
    print(
        "\nbar: (a)-(c) complete, nothing applied twice, accuracy within 1 point:",
        "met" if ok else "MISSED",
    )
    print(
        "bar: (e) the checkpoint folder fills up, the run completes and returns its result "
        "within 1 point, its kept checkpoint loads:",
        ("met" if full_ok else "MISSED") if full else "not run (no tmpfs)",
    )
    _report.write(
        out,
        {"steps": steps, "quick": args.quick, "rows": [{k: r.get(k) for k in cols} for r in rows]},
        bars=[
            {"name": "(a)-(c) complete, nothing applied twice, within 1 point", "met": ok},
            {
                "name": "(e) the checkpoint folder fills up: completes, within 1 point",
                "met": full_ok,
            },
        ],
    )
    return 0 if (ok and full_ok) or not args.check else 1


def shard_kills(task, n: int, steps: int, quick: bool, out, check: bool, case="shard-kills"):
    """Case (f) (or ``case``): ``n`` shard kills over runs of KILLS_PER_RUN, ASP and BSP in
    turn (the figures are written after each run)."""
    rows: list[dict] = []
    cols = ["consistency", "completed", "kills", "acked_lost", "applied_twice", "torn", "replay_eq",
            "shard_s", "recover_s", "time_s"] + ["sources"] * (case == "replica-kills")  # fmt: skip
    while (left := n - sum(r.get("kills", 0) for r in rows)) > 0 and len(rows) < 4 * n:
        consistency = (sw.ASP(), sw.BSP())[len(rows) % 2]
        kills = min(left, KILLS_PER_RUN)
        rows.append(run(task, consistency, case, steps, 0.0, quick, len(rows), kills))
        print(format_table(rows[-1:], cols), flush=True)
        ok = _shard_kills_total(rows, steps, quick, out)
    return 0 if ok or not check else 1


def _shard_kills_total(rows: list[dict], steps: int, quick: bool, out) -> bool:
    """Prints and writes case (f)'s totals over ``rows``; whether its bar is met."""
    keys = ("kills", "acked_lost", "applied_twice", "torn")
    total: dict = {key: sum(r.get(key, 0) for r in rows) for key in keys}
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    recover = [r["recover_s"] for r in rows if not math.isnan(r.get("recover_s", math.nan))]
    serving = [r["shard_s"] for r in rows if not math.isnan(r.get("shard_s", math.nan))]
    total |= {
        "runs": len(rows),
        "completed": sum(r["completed"] == "yes" for r in rows),
        "replay_eq": sum(bool(r.get("replay_eq")) for r in rows),
        "shard_s_mean": mean(serving),
        "recover_s_mean": mean(recover),
        "recover_s_max": max(recover, default=math.nan),
        "load": os.getloadavg(),
    }
    xs = [x for r in rows for x in r.get("pause_backup_s", [])]
    total |= {"pause_backup_s_mean": mean(xs), "pause_backup_n": len(xs)}
    if any("sources" in r for r in rows):  # replica-kills: restarts by source
        total["sources"] = dict(
            sum((collections.Counter(r.get("sources")) for r in rows), collections.Counter())
        )
    print(f"digits MLP, {WORKERS} workers, {SHARDS} shards, {steps} pushes per run:", total)
    ok = total["completed"] == len(rows) == total["replay_eq"] and not (
        total["acked_lost"] or total["applied_twice"] or total["torn"]
    )
    print("bar: (f) 0 lost, 0 twice, 0 torn, every replay equal:", "met" if ok else "MISSED")
    _report.write(
        out,
        {"steps": steps, "quick": quick, "total": total, "rows": rows},
        bars=[{"name": "(f) 0 lost, 0 twice, 0 torn, every replay equal", "met": ok}],
    )
    return ok


ONE_HOT = """
import os, sys, time
import numpy as np
import stalewise as sw

if __name__ == "__main__":
    steps, workers, bsp, replicas = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bsp", int(sys.argv[4])
    job = sw.Job({"items": np.zeros((workers, steps), np.float32)},
                 optimizer=sw.optim.sgd(float(workers) if bsp else 1.0),
                 consistency=sw.BSP() if bsp else sw.ASP(), replicas=replicas)
    ctx = sw.init(job)
    acked = os.open(f"acked-{ctx.rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(acked, b"start %d %f\\n" % (ctx.client.pushed, time.time()))
    while not ctx.should_stop():
        i = ctx.state.get("i", 0)
        ctx.client.pull()
        g = np.zeros((workers, steps), np.float32)
        g[ctx.rank, i] = -1.0
        ctx.client.push({"items": g})
        ctx.client.wait()
        os.write(acked, b"%d %f\\n" % (ctx.client.pushed, time.time()))
        ctx.state["i"] = i + 1
        time.sleep(0.004)
    ctx.close()
"""


def launcher_kills(n: int, out, check: bool, replicas=1, steps: int = 4000, every: int = 50) -> int:
    """Case (g): ``n`` launcher kills (:func:`_kills_case`)."""
    cols = ["consistency", "completed", "kills", "acked_lost", "twice", "skipped", "replayed",
            "rank_skips", "first_push_s", "fresh_s", "time_s"]  # fmt: skip
    return _kills_case("g", "one-hot job, 2 ranks", _one_hot_kills, cols, "firsts", n, steps,
                       every, out, check, replicas)  # fmt: skip


def _kills_case(case, what, run, cols, times, n, steps, every, out, check, replicas) -> int:
    """Case ``case``: ``n`` kills, half under ASP and half under BSP, in runs of the one-hot
    job (``run(folder, consistency, kills, steps, every, rng, replicas=)``, each ended by a
    run to its end); its rows' totals (the columns from ``kills`` up to the first time, and the
    times each row lists under ``times``), printed and written by :func:`_kills_bar`."""
    seed = int(time.time())
    print("seed", seed, flush=True)
    rows, rng = [], random.Random(seed)
    for k, consistency in enumerate(("asp", "bsp")):
        kills = n // 2 + (k < n % 2)
        with tempfile.TemporaryDirectory(prefix=f"faults-{case}-") as folder:
            rows.append(run(Path(folder), consistency, kills, steps, every, rng, replicas=replicas))
        print(format_table(rows[-1:], cols), flush=True)
    stat = cols[cols.index("fresh_s") - 1]  # the row's time column: first_push_s or ready_s
    total: dict = {key: sum(r[key] for r in rows) for key in cols[2 : cols.index(stat)]}
    xs = [t for r in rows for t in r.pop(times)]
    total |= {"runs": len(rows), "completed": sum(r["completed"] == "yes" for r in rows),
              f"{stat}_mean": float(np.mean(xs)) if xs else math.nan,
              f"{stat}_median": float(np.median(xs)) if xs else math.nan,
              f"{stat}_max": max(xs, default=math.nan),
              "fresh_s": [r["fresh_s"] for r in rows], "seed": seed, "load": os.getloadavg(),
              "replicas": replicas}  # fmt: skip
    return _kills_bar(case, f"{what}, replicas={replicas}", total, rows, n, steps, every, out,
                      check)  # fmt: skip


def _kills_bar(case, what, total, rows, n, steps, every, out, check) -> int:
    """Prints and writes a kills case's totals; its exit status (1: bar missed, ``check``)."""
    print(f"{what}, {steps} pushes per run, a checkpoint every {every}:", total)
    ok = total["completed"] == len(rows) and total["kills"] == n
    ok = ok and not (total["acked_lost"] or total["twice"] or total["skipped"])
    name = f"({case}) 0 lost, 0 twice, 0 skipped"
    print(f"bar: {name}:", "met" if ok else "MISSED")
    _report.write(out, {"steps": steps, "every": every, "total": total, "rows": rows},
                  bars=[{"name": name, "met": ok}])  # fmt: skip
    return 0 if ok or not check else 1


def _one_hot_kills(folder: Path, consistency: str, kills: int, steps: int, every: int,
                   rng: random.Random, replicas: int = 1) -> dict:  # fmt: skip
    """One job: ``kills`` launcher kills and resumes, then a run to its end."""
    workers, started, errs, killed = 2, time.monotonic(), [], 0
    (folder / "job.py").write_text(ONE_HOT)
    acks = [folder / f"acked-{r}" for r in range(workers)]
    firsts, row = [], {"consistency": consistency, "completed": "no"}
    for attempt in range(kills + 1):
        args = [sys.executable, "-m", "stalewise", "run", "--workers", str(workers), "--steps",
                str(steps), "--checkpoint-dir", "ckpt", "--checkpoint-every", str(every),
                *(["--resume"] if attempt else []), "job.py", str(steps), str(workers),
                consistency, str(replicas)]  # fmt: skip
        begun = time.time()
        proc = subprocess.Popen(args, cwd=folder, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        try:
            first = None
            while first is None and proc.poll() is None and time.time() - begun < 120:
                first = _first_ack(acks, begun)
                time.sleep(0.01)
            if first is not None:
                firsts.append(first - begun)
            if attempt < kills:
                time.sleep(rng.uniform(0.0, 1.5))
                if proc.poll() is None:
                    proc.kill()  # the launcher alone: its ranks and shards die with it
                    killed += 1
            errs.append(proc.communicate(timeout=600)[1])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if attempt == kills and proc.returncode == 0:
            row["completed"] = "yes"
    err = "".join(errs)
    final = checkpoint.load(folder / "ckpt")
    items = final.flat().reshape(workers, steps)
    made = [int(r["i"]) for r in final.ranks]
    row |= {
        "kills": killed,
        "acked_lost": sum(_acked_lost(path) for path in acks),
        "twice": int((items > 1.5).sum()),
        "skipped": sum(int((items[r, :m] < 0.5).sum()) for r, m in enumerate(made)),
        "replayed": sum(int(b) - int(a) for a, b in re.findall(RESUMED, err)),
        "rank_skips": sum(int(x) for x in re.findall(r"it skips its next (\d+)", err)),
        "first_push_s": sum(firsts[1:]) / max(len(firsts) - 1, 1),
        "fresh_s": firsts[0] if firsts else math.nan,
        "time_s": time.monotonic() - started,
        "firsts": firsts[1:],
    }
    return row


RESUMED = r"resumed from \S*ckpt-(\d+) \(version \d+, (\d+) pushes\)"  # with the logs'


def _first_ack(acks: list[Path], since: float) -> float | None:
    """The time of the first push acknowledged in a run started at ``since`` (None: none yet)."""
    times = []
    for path in acks:
        with contextlib.suppress(FileNotFoundError):
            lines = path.read_text().splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("start ")]
            if starts and float(lines[starts[-1]].split()[2]) >= since:
                times += [float(line.split()[1]) for line in lines[starts[-1] + 1 : starts[-1] + 2]]
    return min(times, default=None)


def _acked_lost(path: Path) -> int:
    """Over a rank's runs (its ack file), the acknowledged pushes each resume lacked."""
    lost = most = 0
    for line in path.read_text().splitlines():
        n = int(line.split()[-2])
        if line.startswith("start"):
            lost += max(most - n, 0)
        most = max(most, n)
    return lost


ONE_HOT_TRAIN = """
import itertools, os, struct, time
import numpy as np

def data(worker, workers):
    return ((worker, i) for i in itertools.count())

class OneHot:
    '''Batch (w, i) adds 1 to item (w, i); the highest i begun is written to begun-A-W.'''

    def __init__(self, attempt, row):
        self.folder, self.attempt, self.row, self.fd, self.top = os.getcwd(), attempt, row, None, -1

    def __call__(self, params, batch):
        w, i = batch
        if i > self.top:  # before the computation: a kill cannot hide it
            if self.fd is None:
                path = os.path.join(self.folder, f"begun-{self.attempt}-{w}")
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            self.top = i
            os.pwrite(self.fd, struct.pack("<q", i), 0)
        time.sleep(0.003)
        g = np.zeros((2, self.row), np.float32)
        g[w, i] = -1.0
        return 0.0, {"items": g}

class First:
    '''evaluate: writes the parameters the run starts from (its first call).'''

    def __init__(self, path):
        self.path = path

    def __call__(self, params):
        if not os.path.exists(self.path):
            np.save(self.path, params["items"])
        return {}
"""

TRAIN = """
import logging, sys
import numpy as np
import stalewise as sw
from onehot import First, OneHot, data

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("stalewise.runtime.driver").setLevel(logging.INFO)  # its resume line
    attempt, bsp, steps, row, every, replicas = int(sys.argv[1]), sys.argv[2] == "bsp", *map(int, sys.argv[3:])
    job = sw.Job({"items": np.zeros((2, row), np.float32)}, shards=2, replicas=replicas,
                 optimizer=sw.optim.sgd(2.0 if bsp else 1.0),  # BSP applies a round's mean
                 consistency=sw.BSP() if bsp else sw.ASP())
    job.train(OneHot(attempt, row), data=data, workers=2, steps=steps,
              evaluate=First(f"start-{attempt}.npy"), metrics=sw.Metrics(every=0.2),
              checkpoints=sw.Checkpoints("ckpt", every=every, keep=100, resume=attempt > 0),
              timeouts=sw.Timeouts(total=400))
"""


def parent_kills(n: int, out, check: bool, replicas=1, steps: int = 4000, every: int = 50) -> int:
    """Case (h): ``n`` kills of the ``Job.train`` parent (:func:`_kills_case`)."""
    cols = ["consistency", "completed", "kills", "acked_lost", "twice", "skipped", "replayed",
            "ready_s", "fresh_s", "time_s"]  # fmt: skip
    return _kills_case("h", "one-hot Job.train, 2 workers", _train_kills, cols, "readies", n,
                       steps, every, out, check, replicas)  # fmt: skip


def _train_kills(folder: Path, consistency: str, kills: int, steps: int, every: int,
                 rng: random.Random, replicas: int = 1) -> dict:  # fmt: skip
    """One job: ``kills`` parent kills and resumes, then a run to its end."""
    width, started, errs, killed, lost = 3 * (steps + 2), time.monotonic(), [], 0, 0
    (folder / "onehot.py").write_text(ONE_HOT_TRAIN)
    (folder / "job.py").write_text(TRAIN)
    acked, readies, row = [0, 0], [], {"consistency": consistency, "completed": "no"}
    for attempt in range(kills + 1):
        args = [sys.executable, "job.py", str(attempt), consistency, str(steps), str(width),
                str(every), str(replicas)]  # fmt: skip
        goal = [b + rng.randint(30, 120) for b in _begun(folder, attempt - 1)]
        begun, ready = time.monotonic(), None
        with open(folder / f"stderr-{attempt}", "w") as err:
            proc = subprocess.Popen(args, cwd=folder, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)  # fmt: skip
        try:
            while proc.poll() is None and time.monotonic() - begun < 600:
                done = _begun(folder, attempt)
                if ready is None and max(done) >= 0:
                    ready = time.monotonic() - begun
                    readies.append(ready)
                if attempt < kills and any(b >= g for b, g in zip(done, goal, strict=True)):
                    break
                time.sleep(0.01)
            if attempt < kills:
                time.sleep(rng.uniform(0.0, 0.3))
                if proc.poll() is None:
                    proc.kill()  # the parent alone: its shards and workers die with it
                    killed += 1
            proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if attempt == 0:
            row["fresh_s"] = ready if ready is not None else math.nan
        if attempt == kills and proc.returncode == 0:
            row["completed"] = "yes"
        errs.append((folder / f"stderr-{attempt}").read_text())
        start = folder / f"start-{attempt}.npy"
        if start.exists():  # (else killed before it started) the state it started from
            held = [_made(items) for items in np.load(start)]
            lost += sum(max(a - h, 0) for a, h in zip(acked, held, strict=True))
        # a batch begun: every push up to two before it was acknowledged (one in flight)
        acked = [max(b - 1, a) for b, a in zip(_begun(folder, attempt), acked, strict=True)]
    items = checkpoint.load(folder / "ckpt").flat().reshape(2, width)
    row |= {
        "kills": killed,
        "acked_lost": lost,
        "twice": int((items > 1.5).sum()),
        "skipped": sum(int((w[: _made(w)] < 0.5).sum()) for w in items),
        "replayed": sum(int(x) for x in re.findall(r"and (\d+) pushes of its logs", "".join(errs))),
        "ready_s": float(np.median(readies[1:])) if readies[1:] else math.nan,
        "time_s": time.monotonic() - started,
        "readies": readies[1:],
    }
    if row["completed"] != "yes":
        row["completed"] = (errs[-1].strip().splitlines() or ["no"])[-1]
    return row


def _begun(folder: Path, attempt: int) -> list[int]:
    """Each worker's highest batch whose computation began in run ``attempt`` (-1: none)."""
    out = []
    for w in range(2):
        path = folder / f"begun-{attempt}-{w}"
        data = path.read_bytes()[:8] if path.exists() else b""
        out.append(int.from_bytes(data, "little", signed=True) if len(data) == 8 else -1)
    return out


def _made(items: np.ndarray) -> int:
    """How many items of a worker's row were reached: one past its last nonzero."""
    nonzero = np.flatnonzero(items)
    return int(nonzero[-1]) + 1 if len(nonzero) else 0


SERVE_ONE_HOT = """
import os, sys
import numpy as np
import stalewise as sw

if __name__ == "__main__":
    name, steps, bsp, every, resume, replicas = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "bsp", *map(int, sys.argv[4:])
    job = sw.Job({"items": np.zeros((2, steps), np.float32)}, shards=2, replicas=replicas,
                 optimizer=sw.optim.sgd(2.0 if bsp else 1.0),  # BSP applies a round's mean
                 consistency=sw.BSP() if bsp else sw.ASP())
    saves = sw.Checkpoints("ckpt", every=every, resume=bool(resume))
    with job.serve(workers=2, name=name, checkpoints=saves) as server:
        open(f"served-{name}", "w").close()
        sys.stdin.readline()
"""

ATTACHED = """
import os, sys, time
import numpy as np
import stalewise as sw

if __name__ == "__main__":
    name, w, n, steps = sys.argv[1], *map(int, sys.argv[2:])
    client = sw.attach(name, worker=w)
    acked = os.open(f"acked-{w}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(acked, b"start %d %f\\n" % (client.pushed, time.time()))
    while (i := client.pushed) < n:  # its next item: one past its pushes the shards hold
        client.pull(timeout=60)
        g = np.zeros((2, steps), np.float32)
        g[w, i] = -1.0
        client.push({"items": g}, timeout=60)
        client.wait(timeout=60)
        os.write(acked, b"%d %f\\n" % (client.pushed, time.time()))
        time.sleep(0.004)
    client.close()
"""


def serve_kills(n: int, out, check: bool, replicas=1, steps: int = 6000, every: int = 50) -> int:
    """Case (i): ``n`` kills of the process serving ``job.serve`` (:func:`_kills_case`)."""
    cols = ["consistency", "completed", "kills", "acked_lost", "twice", "skipped", "replayed",
            "first_push_s", "fresh_s", "time_s"]  # fmt: skip
    return _kills_case("i", "one-hot job.serve, 2 attached workers, 2 shards", _serve_kills,
                       cols, "firsts", n, steps, every, out, check, replicas)  # fmt: skip


def _serve_kills(folder: Path, consistency: str, kills: int, steps: int, every: int,
                 rng: random.Random, timeout: float = 120.0, replicas: int = 1) -> dict:  # fmt: skip
    """One job: ``kills`` kills of its serving process, each relaunched with resume (and
    its 2 workers), then a run to its end; each process started is killed at the end."""
    (folder / "serve.py").write_text(SERVE_ONE_HOT)
    (folder / "worker.py").write_text(ATTACHED)
    name, started, killed, firsts = (
        f"faults-{os.getpid()}-{time.time_ns()}",
        time.monotonic(),
        0,
        [],
    )
    acks, row = [folder / f"acked-{w}" for w in range(2)], {"consistency": consistency}
    row["completed"] = "no"
    for attempt in range(kills + 1):
        begun, named, procs = time.time(), f"{name}-{attempt}", []
        deadline = time.monotonic() + timeout
        try:
            server = _started(folder, procs, attempt, "serve.py", named, steps, consistency,
                              every, int(attempt > 0), replicas, stdin=subprocess.PIPE)  # fmt: skip
            while not (folder / f"served-{named}").exists() and server.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            workers = [_started(folder, procs, attempt, "worker.py", named, w, steps // 2, steps)
                       for w in range(2)]  # fmt: skip
            goal = [n + rng.randint(20, 120) for n in _last_acked(acks)]
            first = None
            while server.poll() is None and time.monotonic() < deadline:
                first = first or _first_ack(acks, begun)
                going = [n < g for n, g in zip(_last_acked(acks), goal, strict=True)]
                if all(p.poll() is not None for p in workers) or (
                    attempt < kills and not all(going)
                ):
                    break
                time.sleep(0.01)
            if first is not None:
                firsts.append(first - begun)
            if attempt < kills:
                time.sleep(rng.uniform(0.0, 0.3))
                if server.poll() is None:
                    server.kill()  # the serving process alone: its shards die with it
                    killed += 1
                with contextlib.suppress(subprocess.TimeoutExpired):
                    for p in workers:  # they fail (their shards are gone), or are killed
                        p.wait(timeout=10)
            else:
                ok = all(p.wait(timeout=max(deadline - time.monotonic(), 0.1)) == 0
                         for p in workers)  # fmt: skip
                server.communicate(b"stop\n", timeout=max(deadline - time.monotonic(), 0.1))
                row["completed"] = "yes" if ok and server.returncode == 0 else "no"
        except subprocess.TimeoutExpired:
            row["completed"] = f"no (run {attempt} timed out)"
            break
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                if p.stdin:
                    p.stdin.close()
    errs = "".join(p.read_text() for p in sorted(folder.glob("err-*")))
    final = checkpoint.load(folder / "ckpt")
    items = final.flat().reshape(2, steps)
    if final.step["pushed"] != [steps // 2] * 2:
        row["completed"] = f"no (pushed {final.step['pushed']})"
    row |= {
        "kills": killed,
        "acked_lost": sum(_acked_lost(path) for path in acks),
        "twice": int((items > 1.5).sum()),
        "skipped": sum(int((w[: _made(w)] < 0.5).sum()) for w in items),
        "replayed": sum(int(b) - int(a) for a, b in re.findall(RESUMED, errs)),
        "first_push_s": sum(firsts[1:]) / max(len(firsts) - 1, 1),
        "fresh_s": firsts[0] if firsts else math.nan,
        "time_s": time.monotonic() - started,
        "firsts": firsts[1:],
    }
    if row.get("completed") != "yes":
        row["errors"] = errs[-2000:]
    return row


def _started(folder: Path, procs: list, attempt: int, *args, **popen) -> subprocess.Popen:
    """``python ARGS`` in ``folder``, in its own session, its stderr to a file; appended to
    ``procs``."""
    with open(folder / f"err-{attempt}-{len(procs)}", "w") as err:
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], cwd=folder,
                                      stdout=subprocess.DEVNULL, stderr=err,
                                      start_new_session=True, **popen))  # fmt: skip
    return procs[-1]


def _last_acked(acks: list[Path]) -> list[int]:
    """Each worker's pushes it last saw acknowledged (or started from), by its ack file."""
    lines = [path.read_text().splitlines() if path.exists() else [] for path in acks]
    return [int(ls[-1].split()[-2]) if ls else 0 for ls in lines]


class _RayKiller:
    """Case (j)'s ``on_record``: SIGKILLs a primary or a backup (in turn, ``seed``) of the run
    ``name`` once ``every`` pushes follow the last kill; notes each kill's pause."""

    def __init__(self, name: str, kills: int, every: int, seed: int):
        self.name, self.left, self.every, self.rng = name, kills, every, random.Random(seed)
        self.at, self.kind, self.since = 0, "", 0.0  # the last kill: pushes, kind, time
        self.pauses: dict[str, list[float]] = {"shard": [], "backup": []}

    def __call__(self, record: dict) -> None:
        import ray

        pushes, now = record["pushes"], time.monotonic()
        if self.kind and pushes > self.at + WORKERS:  # the job goes on after the kill
            self.pauses[self.kind].append(now - self.since)
            self.kind = ""
        if self.kind or not self.left or pushes < self.at + self.every:
            return
        kind = ("shard", "backup")[self.left % 2]
        role, prefix = f":{kind}-{self.rng.randrange(SHARDS)}", f"stalewise:{self.name}:"
        names = ray.util.list_named_actors()
        (victim,) = [a for a in names if a.startswith(prefix) and a.endswith(role)]
        try:
            pid = ray.get(ray.get_actor(victim).ready.remote(), timeout=5)["pid"]
        except (ray.exceptions.RayError, ValueError):
            return  # restarting still: the next record tries again
        os.kill(pid, signal.SIGKILL)
        self.left, self.at, self.kind, self.since = self.left - 1, pushes, kind, now


def ray_replica_kills(n: int, out, check: bool, every: int = 100, seed: int = 0) -> int:
    """Case (j): one replicas=2 run on Ray with ``n`` kills of primaries and backups."""
    import ray

    from stalewise.checkpoint import replay, store

    task = tasks.get("least-squares", n=256, d=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=SHARDS, replicas=2)
    name, steps = f"rep-kills-{seed}", (n + 2) * every
    kill = _RayKiller(name, n, every, seed)
    folder = Path(tempfile.mkdtemp(prefix="faults-ray-"))
    ray.init("local", num_cpus=WORKERS + SHARDS, include_dashboard=False, logging_level="error")
    t = time.monotonic()
    try:
        r = job.train(task.loss_and_grad, data=task.batches, workers=WORKERS, steps=steps,
                      runtime="ray", metrics=sw.Metrics(every=0.05, name=name, on_record=kill),
                      failures=sw.Failures(max_restarts=None),
                      checkpoints=sw.Checkpoints(folder, every=500, keep=10**6),
                      timeouts=sw.Timeouts(total=600.0))  # fmt: skip
        elapsed = time.monotonic() - t
        first = min(p.name for p in store._complete(folder))  # before any push
        flat, ckpt, read = replay.replay(folder, job.config, first)
        log_twice = sum(_twice(job, ckpt, k, folder) for k in range(SHARDS))
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    info = r.stats["ray"]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    row = {
        "kills": n - kill.left,
        "pushes": r.pushes,
        "acked_lost": sum(max(info["acked"] - a, 0) for a in info["applied"]),
        "twice": sum(max(a - info["acked"], 0) for a in info["applied"]),
        "rolled_back": sum(e.get("source") != "backup" for e in r.failures if "shard" in e),
        "backups": info["backups"],
        "replaced": info["backups_replaced"],
        "primary_s": mean(kill.pauses["shard"]),
        "backup_s": mean(kill.pauses["backup"]),
        "primary_s_max": max(kill.pauses["shard"], default=math.nan),
        "backup_s_max": max(kill.pauses["backup"], default=math.nan),
        "logs": len(read),  # log files replayed, from the checkpoint before any push
        "from_pushes": ckpt.step["pushes"],
        "log_twice": log_twice,
        "replay_eq": flat.tobytes() == r.flat.tobytes(),
        "time_s": elapsed,
        "seed": seed,
        "load": os.getloadavg(),
    }
    print(f"least-squares on Ray, {WORKERS} workers, {SHARDS} shards, replicas=2, {steps} pushes")
    print(format_table([row], list(row)))
    ok = row["kills"] == n and not (row["acked_lost"] or row["twice"] or row["rolled_back"])
    ok = ok and row["backups"] == ["equal"] * SHARDS and row["replay_eq"] and not log_twice
    what = "(j) 0 lost, 0 twice, no rollback, backups equal, replay equal"
    print(f"bar: {what}:", "met" if ok else "MISSED")
    bars = [{"name": what, "met": ok}]
    _report.write(out, {"steps": steps, "row": row}, bars=bars)
    return 0 if ok or not check else 1


if __name__ == "__main__":
    sys.exit(main())
