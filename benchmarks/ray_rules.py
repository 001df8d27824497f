"""How much of the Ray runtime decides a rule: the counting method of ``docs/design-notes.md``.

Code lines are the lines of ``stalewise/runtime/ray/*.py`` that hold a token other than
a comment (``tokenize``), less docstrings (``ast``). A rule line is a code line that
decides a condition, count or choice a rule of ``protocol/`` could state, rather than
call one or move bytes; :data:`RULES` lists them, function by function, each by a piece
of its text found on exactly one code line of that function. A listed piece that is no
longer found stops the count: the listing is kept with the code.

Run: ``.venv/bin/python benchmarks/ray_rules.py [-v]`` (``-v``: every rule line).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "stalewise" / "runtime" / "ray"

RULES: dict[str, dict[str, list[str]]] = {
    "client.py": {
        "RayClient.__init__": ['info["expected"] or self.workers'],
        "RayClient._may_begin": [
            "if self._rounds:",
            "if ask:",
            "flying = int(self._pending is not None)",
            "flying = int(self._pending is not None)",
            "if budget.settle_first(",
        ],
        "RayClient.pull_flat": [
            "if own:",
            "self.pull_has_own = ",
            "fresh = ",
            "self._round = max(",
        ],
        "RayClient.push": ["self.wait()", "granted, self._granted", "self._round += 1"],
        "RayClient.wait": ["self._acked, self._handled = seq + 1"],
        "RayClient.close": ["residual = self.residual if self._pending is None"],
    },
    "cluster.py": {
        "consistent_states": ["or time.monotonic() > deadline"],
        "depart": ["for k, (start, stop) in lacking.items()"],
    },
    "liveness.py": {
        "Liveness.__init__": ["min(1.0, worker_timeout / 4)"],
        "Liveness.check": [
            "if beats != x.beats or ready != x.ready:",
            "now - x.asked > self.timeout",
        ],
    },
    "outbox.py": {
        "Outbox.send": ["if residual is not None and self.keeper is not None:"],
        "Outbox.collect": ["if any(r is None for r in replies):"],
    },
    "server.py": {
        "Door.attach": ["self.incs[w] += 1", '"joined_at": int(max(clocks))'],
        "Door._free": ["if w not in self.held:"],
        "Door._watch": ["if self.held.get(w) == inc:"],
        "Door.detach": ["if self.held.get(w) == inc:", "if residual is not None:"],
    },
    "shard.py": {
        "ShardActor.__init__": ["self.several = len(config.ranges) > 1"],
        "ShardActor.load": [
            "for w in gone:",
            "if self.shard.live[w]:",
            "for w, inc in joins.items():",
        ],
        "ShardActor.depart": [
            "for seq, bases, verdict, update in committed or ()",
            "if ack is not None:",
            "if not self.exact:",
        ],
        "ShardActor.pull": [
            "exact=self.exact or self.pub.version < fresh",
            "if shard.staleness.dc_lambda or shard.hybrid:",
        ],
        "ShardActor.follow": [
            "if self.shard.admitted[w] == inc:",
            "if self.pub.version < 0:",
            "if self.pub.version > seen:",
        ],
        "ShardActor._ended": ['("moved", dropped) if dropped else ("gone",)'],
        "ShardActor.push": [
            "if shard.admitted[w] != inc:",
            "if self.several:",
            "if not self.exact:",
        ],
        "ShardActor._count": ["if ack.staleness is not None and not ack.duplicate:"],
        "ShardActor._publish_soon": [
            "followers = ",
            "if self.timer is not None or wait is None:",
            "if wait <= 0:",
        ],
        "ShardActor._publish_held": ["if self.pub.version != self.shard.version:"],
    },
    "train.py": {
        "_Host._start_shards": [
            'restarts = 0 if o.on_worker_failure == "fail"',
            "expected = 0",
            "max(self.expected, min(self.W, self._room()))",
        ],
        "_Host._open_shards": [
            'self.incs[w] = max(int(np.asarray(s["incarnation"])[w]) for s in states)',
            "joins = {w: self.incs[w] + 1 for w in self.started}",
        ],
        "_Host._spawn": ["if residual is not None:"],
        "_Host._start_workers": ["if refs[r] >= self.expected)"],
        "_Host.advance": ["if self.owed and not self.live:"],
        "_Host._grow": [
            "if self.stopping or self.ended or self.coming:",
            "w not in self.live and w not in self.retired",
            "self.incs[w] += 1",
        ],
        "_Host._arrive": ["if self.stopping or self.ended:"],
        "_Host._worker_ended": [
            'if "diverged" in ended:',
            'if not self.stopping and ended["feedback"][0] < self.incs[w]:',
        ],
        "_Host._node_left": ["if not self.elastic:"],
        "_Host._worker_failed": [
            'if action == "drop" or self.stopping:',
            'if action == "drop":',
            "self.incs[w] += 1",
        ],
        "_Host._depart": ["if residual is None:"],
        "_Host._residual": ["if residual is None and pushes and self.keepers[w] is not None:"],
        "_Host._restore": [
            "owed, self.owed = set() if self.stopping else self.owed, set()",
            "for w in budget.after_rollback(self.live, owed):",
            "self.incs[w] += 1",
            "self.fb[w].clear()",
            "gone = [w for w in range(self.W) if w not in joins]",
            "if self.stopping:",
            "for w in sorted(owed):",
        ],
        "_Host.snapshot": ["if failure:"],
        "_Host._snapshot": ["if self.ef and residuals is None:"],
        "_Host._residuals": ["if residual is None:"],
    },
    "worker.py": {
        "WorkerActor._answerer.answer": [
            "if not request.settle:",
            "self.settled = (self.inc, list(self.out.sender.known))",
        ],
        "WorkerActor._newest": [
            "if self.moved_to > self.inc:",
        ],
        "WorkerActor._whole": [
            "if any(s is None for s in self.latest):",
            "if self.settled is None or self.settled[0] != self.inc:",
            "return all(s[0] >= v",
        ],
        "WorkerActor._pull": [
            'if "stop" in kinds or "gone" in kinds:',
            'moved = [r[1] for r in replies if r[0] == "moved"]',
        ],
        "WorkerActor._budget_spent": [
            "if round_ is not None and self.config.consistency.averages_rounds:",
            "flying = len(self.jobs)",
            "if not budget.settle_first(",
        ],
        "WorkerActor._become": ["self.inc, self.acked = inc, 0", "self.moved_to = max("],
        "WorkerActor._push": ["while len(self.jobs) >= pipeline.IN_FLIGHT:"],
        "WorkerActor._send_loop": [
            "acked = self.acked if inc == self.inc else 0",
            "self.acked = max(self.acked, seq + 1)",
        ],
        "WorkerActor._receive_loop": [
            'if reply[0] == "moved" and reply[1] > inc:',
            "inc = self.moved_to = reply[1]",
            "seen = [-1] * self.S",
            "self.latest = [None] * self.S",
            'elif reply[0] == "ok" and asked == inc:',
        ],
    },
}


def code_lines(source: str) -> set[int]:
    """The numbers of the lines of ``source`` that hold code (no comment, no docstring)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type not in skip | {tokenize.ENDMARKER}:
            lines.update(range(t.start[0], t.end[0] + 1))
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
            lines -= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return lines


def functions(tree: ast.AST, prefix: str = "") -> dict[str, ast.AST]:
    """Every function of ``tree`` by its qualified name (``Class.method``, ``f.inner``)."""
    out: dict[str, ast.AST] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                out[name] = node
            out |= functions(node, name + ".")
    return out


def rule_lines(path: Path, listing: dict[str, list[str]]) -> list[tuple[int, str]]:
    """The listed rule lines of ``path``: ``(line number, text)``; raises if one is not
    found on exactly one code line of its function (repeated pieces: that many lines)."""
    source = path.read_text()
    text, code, funcs = source.splitlines(), code_lines(source), functions(ast.parse(source))
    out = []
    for name, pieces in listing.items():
        if name not in funcs:
            raise SystemExit(f"{path.name}: no function {name}")
        node = funcs[name]
        own = [n for n in range(node.lineno, node.end_lineno + 1) if n in code]
        for piece in dict.fromkeys(pieces):
            found = [n for n in own if piece in text[n - 1]]
            if len(found) != pieces.count(piece):
                raise SystemExit(f"{path.name} {name}: {piece!r} is on {len(found)} lines")
            out += [(n, text[n - 1].strip()) for n in found]
    return sorted(out)


def main() -> None:
    total = rules = 0
    for path in sorted(ROOT.glob("*.py")):
        n = len(code_lines(path.read_text()))
        found = rule_lines(path, RULES.get(path.name, {}))
        total, rules = total + n, rules + len(found)
        print(f"{path.name:14s} {n:5d} code lines {len(found):4d} rule lines")
        if "-v" in sys.argv:
            for line, text in found:
                print(f"    {line:4d}  {text}")
    print(f"runtime/ray/: {rules} rule lines of {total} code lines ({100 * rules / total:.1f}%)")


if __name__ == "__main__":
    main()
