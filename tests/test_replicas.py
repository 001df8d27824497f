"""protocol/replica.py, proved by killing every process at every message boundary.

A deterministic message-level model of a small job: 2 workers, 2 shards each kept by a
primary and a backup; every message (join, pull, push, leave, their replies, forward,
held, catch-up) is one event, in the order of its arrival time (worker 1 computes its
pushes 3 times slower than worker 0). Each run kills one process (a worker, a primary, a
backup) at one boundary: before a message it receives or after one it sends (20 pushes
per worker), or before any event of the job (4 pushes); then restarts or promotes per
the rules and runs to the end. Then: every worker finished, every push a worker was told
was applied is applied exactly once in every live copy, the copies agree bit for bit,
and a replay of the log from the initial state gives the same state."""

import copy
import heapq
import itertools
import time
from collections import Counter, defaultdict

import mp_helpers
import numpy as np
import pytest

from stalewise import optim
from stalewise.consistency import ASP, BSP, SSP
from stalewise.protocol import PushHeader, Shard, pushlog
from stalewise.protocol.replica import Backup, Outstanding, Primary
from stalewise.segments import Segments

SIZE, PUSHES, WORKERS = 3, 20, 2
TARGETS = np.random.default_rng(1).standard_normal((WORKERS, 2 * SIZE)).astype(np.float32)
CONSISTENCY = {"asp": ASP, "bsp": BSP, "ssp": lambda: SSP(1)}
# gradients into adam; DiLoCo deltas (3 local steps) into an outer nesterov sgd
SERVER = {
    "grad": lambda: optim.adam(0.05),
    "diloco": lambda: optim.sgd(0.7, momentum=0.9, nesterov=True),
}


def make_shard(k, consistency, kind):
    params = np.linspace(-1, 1, 2 * SIZE, dtype=np.float32)[k * SIZE : (k + 1) * SIZE].copy()
    seg = Segments.single(SIZE)
    return Shard(
        params,
        seg,
        SERVER[kind](),
        workers=WORKERS,
        consistency=CONSISTENCY[consistency](),
        shard_id=k,
    )


def update(kind, w, seq, params):
    """A worker's push: a noisy gradient of a quadratic, or a DiLoCo delta."""
    noise = np.float32(0.1) * np.sin(np.arange(params.size, dtype=np.float32) + seq + 7 * w)
    if kind == "grad":
        return params - TARGETS[w] + noise
    local = params.copy()
    for _ in range(3):
        local -= np.float32(0.2) * (local - TARGETS[w] + noise)
    return params - local


SETTINGS = ("segments", "job_segments", "optimizer", "consistency", "staleness", "_fused")


class Worker:
    """One incarnation: joins every shard, then pull, push, until `todo` pushes are answered."""

    def __init__(self, job, w, inc, todo):
        self.job, self.w, self.inc, self.todo = job, w, inc, todo
        self.name, self.out, self.seq = ("w", w, inc), Outstanding(2), 0
        self.answers, self.finished = {}, False

    def ask(self, what, key, *bodies):
        self.answers = {}
        for k in range(2):
            request = (what, self.name, key, *bodies[k : k + 1])
            self.out.sent(k, key, request)
            self.job.send(self.name, self.job.primary[k], request)

    def receive(self, msg):
        _, k, key, answer = msg
        if not self.out.answered(k, key):
            return  # a late second answer (from a dead primary, then the promoted one)
        self.answers[k] = answer
        if len(self.answers) < 2:
            return
        what = key[0]
        if what == "push":
            for k, ack in self.answers.items():
                assert ack.ok, f"worker {self.w}: push refused at shard {k}: {ack.reason}"
                self.job.acked.add((k, self.w, self.inc, ack.seq))
                self.job.duplicates += ack.duplicate
            self.seq += 1
            self.job.done[self.w] += 1
        if what == "pull":
            params = np.concatenate([self.answers[k][1] for k in range(2)])
            flat = update(self.job.kind, self.w, self.seq, params)
            bodies = [
                (
                    PushHeader(self.w, self.seq, self.answers[k][0], self.inc),
                    flat[k * SIZE :][:SIZE],
                )
                for k in range(2)
            ]
            self.ask("push", ("push", self.w, self.inc, self.seq), *bodies)
        elif what == "leave":
            self.finished = True
        elif self.seq < self.todo:
            self.ask("pull", ("pull", self.w, self.inc, self.seq))
        else:
            self.ask("leave", ("leave", self.w, self.inc))


class Copy:
    """One process keeping a copy of shard k: a Primary, a Backup, or (until caught up) None."""

    def __init__(self, job, k, name, role=None):
        self.job, self.k, self.name, self.role, self.hist = job, k, name, role, []
        self.gated = []  # pulls waiting for the consistency gate

    def __deepcopy__(self, memo):
        new = memo[id(self)] = copy.copy(self)
        vars(new).update({k: copy.deepcopy(v, memo) for k, v in vars(self).items() if k != "hist"})
        new.hist = list(self.hist)  # entries are bytes
        return new

    def receive(self, msg):
        job, role, what = self.job, self.role, msg[0]
        if what == "catchup":
            start, self.hist = msg[1:]
            self.role = Backup(job.new_shard(self.k), start)
        elif what == "forward":
            if isinstance(role, Backup):  # else: the dead primary's, to the promoted copy
                before, fwd = role.entries, msg[1]
                held = role.receive(fwd)
                if held is not None:
                    self.hist += fwd.entries[before - fwd.first :]
                    job.send(self.name, job.primary[self.k], ("held", held))
        elif what == "held":
            if isinstance(role, Primary):
                self.dispatch(role.held(msg[1]))
        else:
            assert isinstance(role, Primary), (self.name, msg)
            self.serve(msg)
            gated, self.gated = self.gated, []  # pulls the gate may let through now
            for request in gated:
                self.serve(request)
            fwd = role.forward()
            if fwd is not None:
                self.hist += fwd.entries
                if role.backed:
                    job.send(self.name, job.backup[self.k], ("forward", fwd))

    def serve(self, msg):
        what, worker, key = msg[:3]
        s, (_, w, inc) = self.role.shard, worker
        if what == "join":
            self.role.join(w, inc)
            answer = None
        elif s.incarnation[w] != inc:
            return  # a dead incarnation's request: nothing of it is handled
        elif what == "leave":
            answer = s.depart(w, inc)
        elif what == "pull":
            if not s.may_start(w):
                self.job.gated += 1
                self.gated.append(msg)
                return
            out = np.empty_like(s.params)
            answer = (s.pull(w, out), out)
        else:
            answer = s.push(*msg[3])
        self.dispatch(self.role.reply((worker, self.k, key, answer)))

    def dispatch(self, replies):
        for worker, k, key, answer in replies:
            self.job.send(self.name, worker, ("reply", k, key, answer))


class Job:
    """The model: processes by name, one queue of (arrival, order, destination, message). ``kill``:
    (process, "recv", m) kills it before its m-th message in, (process, "send", m) right
    after its m-th message out, (process, "event", i) before the job's i-th event."""

    def __init__(self, consistency, kind, kill=None, pushes=PUSHES):
        self.consistency, self.kind, self.kill, self.pushes = consistency, kind, kill, pushes
        self.queue, self.procs, self.dead, self.crashed = [], {}, set(), None
        self.now, self.order = 0, itertools.count()
        self.acked, self.done, self.events, self.duplicates = set(), [0] * WORKERS, 0, 0
        self.gated = 0  # pulls that waited for the consistency gate
        self.sends, self.recvs, self.at = Counter(), Counter(), {}
        self.primary, self.backup, self.spawned = [], [], itertools.count()
        for k in range(2):
            p, b = f"s{k}a", f"s{k}b"
            primary = Primary(self.new_shard(k))
            self.procs[p] = Copy(self, k, p, primary)
            self.procs[b] = Copy(self, k, b, Backup(self.new_shard(k), primary.attach()))
            self.primary.append(p)
            self.backup.append(b)
        for w in range(WORKERS):
            self.start(w, 1, pushes)

    def new_shard(self, k):
        return make_shard(k, self.consistency, self.kind)

    def start(self, w, inc, todo):
        worker = self.procs[("w", w, inc)] = Worker(self, w, inc, todo)
        worker.ask("join", ("join", w, inc))

    def send(self, src, dst, msg):
        if src in self.dead:
            return
        self.sends[src] += 1
        delay = 1 + 2 * (msg[0] == "push") * (1 + 2 * (src[1:2] == (1,)))  # compute time
        heapq.heappush(self.queue, (self.now + delay, next(self.order), dst, msg))
        self.point((src, "send", self.sends[src]), now=False)

    def point(self, point, now=True):
        """A kill point reached: note the event it is at (clean run), or kill there."""
        if self.at is not None:  # the clean run
            self.at[point] = self.events
        elif point == self.kill:
            self.dead.add(point[0])
            if now:
                self.recover(point[0])
            else:
                self.crashed = point[0]  # noticed once its handler is over

    def run(self):
        while self.step():
            pass
        return self

    def step(self):
        """Delivers the next message; False once none is left."""
        if self.crashed is not None:
            self.recover(self.crashed)
        if self.at is not None or (self.kill is not None and self.kill[1] == "event"):
            for name in TARGETS_KILLED:
                if name not in self.dead:
                    self.point((name, "event", self.events))
        if not self.queue:
            for name in TARGETS_KILLED:
                if name not in self.dead:  # after its last message
                    self.point((name, "recv", self.recvs[name]))
            return bool(self.queue)
        self.now, _, dst, msg = heapq.heappop(self.queue)
        if dst not in self.dead:
            self.point((dst, "recv", self.recvs[dst]))
        if dst not in self.dead:
            self.recvs[dst] += 1
            self.procs[dst].receive(msg)
        self.events += 1
        return True

    def recover(self, name):
        """What the launcher does once `name` died: a worker's next incarnation starts; a
        primary's backup is promoted and the workers resend to it; a new backup catches up."""
        self.crashed = None
        proc = self.procs[name]
        if isinstance(proc, Worker):
            self.start(proc.w, proc.inc + 1, self.pushes - self.done[proc.w])
            return
        k = proc.k
        if name == self.primary[k]:
            survivor = self.procs[self.backup[k]]
            survivor.role = survivor.role.promote()
            self.primary[k] = survivor.name
            for worker in self.live_workers():
                for request in worker.out.resend(k):
                    self.send(worker.name, survivor.name, request)
        else:
            survivor = self.procs[self.primary[k]]
            survivor.dispatch(survivor.role.detach())
        name = f"s{k}{next(self.spawned)}"
        start = survivor.role.attach()
        self.procs[name] = Copy(self, k, name)
        self.backup[k] = name
        self.send(survivor.name, name, ("catchup", start, survivor.hist[: start.entries]))

    def live_workers(self):
        return [p for n, p in self.procs.items() if isinstance(p, Worker) and n not in self.dead]


TARGETS_KILLED = [("w", 0, 1), ("w", 1, 1), "s0a", "s0b", "s1a", "s1b"]


def assert_same_state(a, b):
    """Two state dicts are equal, arrays bit for bit (dtype and shape included)."""
    assert list(a) == list(b)
    for key, x in a.items():
        y = b[key]
        if isinstance(x, np.ndarray):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), key
        else:
            assert type(x) is type(y) and x == y, key


def applied(k, entries, results):
    """The pushes a log applied (not refused, not duplicates), as (shard, worker, inc, seq)."""
    return [
        (k, ack.worker, entry.fields["header"][3], ack.seq)
        for entry, ack in zip(entries, results, strict=True)
        if entry.op == "push" and ack.ok and not ack.duplicate
    ]


class Replayed:
    """Shard k's log in the clean run, replayed once from the initial state: the state and
    the pushes applied after each entry (a log that begins alike replays from there)."""

    def __init__(self, job, k):
        self.hist, shard = job.procs[job.primary[k]].hist, job.new_shard(k)
        self.states, self.applied, self.counts = [shard.state_dict()], [], [0]
        for data in self.hist:
            entries = pushlog.decode(data)
            self.applied += applied(k, entries, pushlog.replay(shard, entries))
            self.states.append(shard.state_dict())
            self.counts.append(len(self.applied))

    def replay(self, job, k, hist):
        """The state a replay of `hist` from the initial state ends at, and what it applied."""
        same = next(
            (n for n, (a, b) in enumerate(zip(hist, self.hist, strict=False)) if a != b), None
        )
        same = min(len(hist), len(self.hist)) if same is None else same
        shard = job.new_shard(k)
        shard.load_state_dict(self.states[same])
        entries = pushlog.decode(b"".join(hist[same:]))
        done = applied(k, entries, pushlog.replay(shard, entries))
        return shard.state_dict(), self.applied[: self.counts[same]] + done


def check(job, case, clean=None):
    """Every acknowledged push applied once in each live copy; copies and replay agree."""
    assert all(w.finished for w in job.live_workers()), f"{case}: a worker never finished"
    for k in range(2):
        primary, backup = (job.procs[n] for n in (job.primary[k], job.backup[k]))
        assert isinstance(backup.role, Backup), f"{case}: shard {k}'s backup never caught up"
        assert primary.hist == backup.hist, f"{case}: shard {k}: the copies' logs differ"
        assert len(primary.hist) == primary.role.entries == backup.role.entries, case
        state, done = (clean or [Replayed(job, k)] * 2)[k].replay(job, k, primary.hist)
        assert_same_state(primary.role.shard.state_dict(), state)
        assert_same_state(backup.role.shard.state_dict(), state)
        counts = Counter(done)
        assert max(counts.values()) == 1, f"{case}: shard {k} applied a push twice"
        lost = {a for a in job.acked if a[0] == k} - set(counts)
        assert not lost, f"{case}: acknowledged pushes {sorted(lost)[:3]} not applied"


def kill_points(clean, every_event):
    """Each process of the clean run, before each message it receives and after each it
    sends; or before each event of the job."""
    for target in TARGETS_KILLED:
        if every_event:
            yield from ((target, "event", i) for i in range(clean.events + 1))
        else:
            yield from ((target, "recv", m) for m in range(clean.recvs[target] + 1))
            yield from ((target, "send", m) for m in range(1, clean.sends[target] + 1))


def fault_cases(consistency, kind, pushes=PUSHES, every_event=False):
    """Runs the job once clean and once per kill point, every other one in a second process;
    returns the number of runs, those with a resent push answered as a duplicate, the clean
    run."""
    t = time.perf_counter()
    mine, other = mp_helpers.in_two(kill_runs, consistency, kind, pushes, every_event)
    clean, runs, retried = mine[0], 1 + mine[1] + other[1], mine[2] + other[2]
    took = time.perf_counter() - t
    print(f"{consistency} {kind}, {pushes} pushes per worker: {clean.events} events, {runs} runs")
    print(f"  {retried} with a resent push answered as a duplicate; {took:.1f} s")
    return runs, retried, clean


def kill_runs(consistency, kind, pushes, every_event, part):
    """The clean run, checked, and a run per kill point of the ``part``-th half (0 or 1);
    returns the clean run (part 0), the kill runs and those with a duplicate. A run is the
    clean one up to its kill, so it starts from a copy of the clean run there."""
    clean = Job(consistency, kind, pushes=pushes).run()
    replayed = [Replayed(clean, k) for k in range(2)]
    check(clean, (consistency, kind, "no kill"), replayed)
    assert clean.done == [pushes] * WORKERS
    due = defaultdict(list)
    for kill in itertools.islice(kill_points(clean, every_event), part, None, 2):
        due[clean.at[kill]].append(kill)
    runs, retried, job = 0, 0, Job(consistency, kind, pushes=pushes)
    job.at = None
    shared = {}  # what a copy of the job shares with it: the shards' settings
    for c in job.procs.values():
        settings = getattr(getattr(c, "role", None), "shard", None)
        settings = [] if settings is None else [getattr(settings, a) for a in SETTINGS]
        shared.update((id(x), x) for x in settings)
    while True:
        for kill in due.pop(job.events, ()):
            fork = copy.deepcopy(job, dict(shared))
            fork.kill = kill
            check(fork.run(), (consistency, kind, *kill), replayed)
            runs, retried = runs + 1, retried + (fork.duplicates > 0)
        if not job.step():
            break
    assert not due
    return clean if part == 0 else None, runs, retried


@pytest.mark.slow  # about 20 s of CPU each
@pytest.mark.parametrize("kind", ["grad", "diloco"])
@pytest.mark.parametrize("consistency", ["asp", "bsp", "ssp"])
def test_kill_each_process_at_each_of_its_messages(consistency, kind):
    """20 pushes per worker: each process killed before each message it receives (and
    after its last) and after each message it sends."""
    runs, retried, clean = fault_cases(consistency, kind)
    points = sum(clean.recvs[p] + 1 + clean.sends[p] for p in TARGETS_KILLED)
    assert runs == 1 + points
    assert retried > 50  # runs where a resent push was answered as applied already


@pytest.mark.parametrize("kind", ["grad", "diloco"])
@pytest.mark.parametrize("consistency", ["asp", "bsp", "ssp"])
def test_kill_each_process_before_each_event_of_the_job(consistency, kind):
    """4 pushes per worker: each process killed before each event of the whole job (its
    death noticed at any point of the others' progress)."""
    runs, retried, clean = fault_cases(consistency, kind, pushes=4, every_event=True)
    assert runs == 1 + len(TARGETS_KILLED) * (clean.events + 1)
    assert retried > 10


def test_rules_of_the_two_copies():
    """Replies wait for the backup (not when alone); a forward of another view is ignored,
    an overlap applied once, a gap or a garbled entry refused in one line."""
    primary = Primary(make_shard(0, "asp", "grad"))
    assert primary.reply("alone") == ["alone"]
    backup = Backup(make_shard(0, "asp", "grad"), primary.attach())
    primary.join(0, 1)
    primary.join(0, 1)  # resent: nothing changes, no entry
    assert primary.reply("joined") == [] and primary.entries == 1
    first = primary.forward()
    assert backup.receive(first._replace(view=0)) is None and backup.entries == 0
    for _ in range(2):
        primary.shard.pull(0)
    second = primary.forward()
    with pytest.raises(pushlog.LogError, match="shard 0, view 1, entry 0: entry 1 arrived first"):
        backup.receive(second)
    assert backup.entries == 0
    assert primary.held(backup.receive(first)) == ["joined"]
    overlap = second._replace(first=0, entries=first.entries + second.entries)
    assert backup.receive(overlap) == (1, 3) and backup.shard.stats.bytes_out == 0
    garbled = second._replace(first=3, entries=(b"SWJ2" + bytes(8),))
    with pytest.raises(pushlog.LogError, match=r"shard 0, view 1, entry 3: .* not JSON"):
        backup.receive(garbled)
    assert backup.entries == 3
    primary.reply("pulled")
    assert primary.detach() == ["pulled"]
    assert_same_state(backup.promote().shard.state_dict(), primary.shard.state_dict())


def test_a_backup_holds_before_it_applies_and_applies_before_it_serves():
    """Held counts entries held (not applied yet); a promotion applies them first."""
    primary = Primary(make_shard(0, "asp", "grad"))
    backup = Backup(make_shard(0, "asp", "grad"), primary.attach())
    primary.join(0, 1)
    ack = primary.shard.push(PushHeader(0, 0, 0, 1), np.ones(SIZE, np.float32))
    assert primary.reply(ack) == []
    assert primary.held(backup.hold(primary.forward())) == [ack]
    assert len(backup.pending) == 2 and backup.shard.version == 0 and backup.entries == 2
    survivor = backup.promote()
    assert not backup.pending and survivor.entries == 2
    assert_same_state(survivor.shard.state_dict(), primary.shard.state_dict())


def test_a_garbled_entry_is_refused_before_it_is_held():
    """A payload whose checksum fails (a push region rewritten before the backup copied it)
    raises in ``hold``: no Held counts it, nothing is pending."""
    primary = Primary(make_shard(0, "asp", "grad"))
    backup = Backup(make_shard(0, "asp", "grad"), primary.attach())
    primary.join(0, 1)
    primary.shard.push(PushHeader(0, 0, 0, 1), np.ones(SIZE, np.float32))
    fwd = primary.forward()
    garbled = bytearray(fwd.entries[-1])
    garbled[-1] ^= 1
    with pytest.raises(pushlog.LogError, match="checksum does not match"):
        backup.hold(fwd._replace(entries=(*fwd.entries[:-1], bytes(garbled))))
    assert backup.entries == 0 and not backup.pending
