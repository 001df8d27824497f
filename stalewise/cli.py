"""The ``stalewise`` command: ``demo``, ``train CONFIG.toml``, ``sim CONFIG.toml``, ``calibrate
CONFIG.toml``, ``replay CONFIG.toml RUN_DIR``, ``run SCRIPT``. Every flag and config value is
checked before anything starts: a user error prints ``stalewise: <key or flag>: <what was expected,
got what>`` on stderr, status 2; a run that diverged prints why (and what to change), status 1."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger("stalewise")


class _FlagError(Exception):
    """argparse found a bad command line (its message, one line)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors reach :func:`main` instead of exiting with usage text."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _FlagError(f"{message} (see {self.prog} --help)")


def _updates(text: str) -> int:
    """--checkpoint-every's value: an integer >= 1, the one rule of ``run`` and ``train``."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _config_error(key: str, problem: str) -> Exception:
    from stalewise.config import ConfigError

    return ConfigError(key, problem)


def _out_dir(arg: str | None, prefix: str) -> Path:
    out = Path(arg) if arg else Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    return _make_dir(out, "--out", str(out))


def _make_dir(path: Path, flag: str, shown: str) -> Path:
    """``path`` made (with its parents) or a config error naming ``flag`` and ``shown``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _config_error(flag, f"cannot make the folder {shown!r}: {e.strerror or e}") from None
    return path


def cmd_demo(args: argparse.Namespace) -> int:
    from stalewise import demo
    from stalewise.config import ConfigError

    try:
        demo.check_args(workers=args.workers, slowdown=args.slowdown, delay=args.delay)
    except ConfigError as e:
        raise ConfigError(f"--{e.key}", e.problem) from None
    out = _out_dir(args.out, "demo")
    rows = demo.run(
        out, workers=args.workers, slowdown=args.slowdown, delay=args.delay, progress=not args.quiet
    )
    print(demo.summary(rows))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'demo.png'}")
    return 0


def _tensorboard_dir(arg: str | None) -> Path | None:
    """--tensorboard DIR, checked: tensorboardX importable, DIR a folder that can be made."""
    if arg is None:
        return None
    from stalewise import loggers

    try:
        loggers.tensorboard_writer()
    except ImportError as e:
        raise _config_error("--tensorboard", str(e)) from None
    if not arg.strip():
        raise _config_error("--tensorboard", "expected a folder path, got an empty string")
    return _make_dir(Path(arg), "--tensorboard", arg)


def _check_runtime(runtime: str | None) -> None:
    from stalewise import runtime as runtime_lib

    known = runtime_lib.names()
    if runtime is not None and runtime not in known:
        raise _config_error("--runtime", f"unknown runtime {runtime!r} (known: {', '.join(known)})")


def cmd_train(args: argparse.Namespace) -> int:
    from stalewise import config, report
    from stalewise import runtime as runtime_lib
    from stalewise.options import Checkpoints

    _check_runtime(args.runtime)
    if args.resume is not None:
        if args.out is not None:
            raise _config_error("--out", "give --resume RUN_DIR or --out, not both")
        if not (Path(args.resume) / "checkpoints").is_dir():
            raise _config_error(
                "--resume", f"{args.resume!r} holds no checkpoints/ folder of an earlier run"
            )
    cfg = config.load(
        args.config, runtime=args.runtime, codec=args.codec, pull_codec=args.pull_codec
    )
    runtime = runtime_lib.describe(cfg.train_kwargs(args.runtime)["runtime"])
    if args.address is not None and runtime.connect is None:
        raise _config_error("--address", f"is for --runtime {runtime_lib.able('connect')}; "
                            f"this run's runtime is {runtime.name!r}")  # fmt: skip
    board = _tensorboard_dir(args.tensorboard)
    out = _out_dir(args.resume or args.out, Path(args.config).stem)
    loggers = []
    if board is not None:  # one TensorBoard run per run folder: DIR/<run folder's name>
        from stalewise.loggers import TensorBoardLogger

        try:
            loggers.append(TensorBoardLogger(board / out.resolve().name))
        except ValueError as e:
            raise _config_error("--tensorboard", str(e)) from None
    run = Path(args.config).stem
    ckpt = Checkpoints(
        out / "checkpoints", every=args.checkpoint_every, resume=args.resume is not None
    )
    with report.MetricsWriter(out / "metrics.jsonl") as writer:
        metrics = dataclasses.replace(cfg.train["metrics"], name=run,
            on_record=writer.write, loggers=loggers, progress=not args.quiet)  # fmt: skip
        result = cfg.run(args.runtime, address=args.address, metrics=metrics, checkpoints=ckpt)
    simulated = runtime.simulated
    report.plot_runs(
        result.records,
        out / "train.png",
        title=run,
        targets={t.metric: t.value for t in cfg.train.get("stop_at") or ()},
        xlabel="virtual time (s)" if simulated else None,
    )
    last = result.records[-1] if result.records else {}
    row = {"run": run, "time_s": result.time, "pushes": result.pushes}
    row |= {k: last.get(k) for k in ("loss", "accuracy")}
    row |= {k: result.stats.get(k) for k in ("staleness_mean", "staleness_max")}
    print(report.format_table([row], list(row)))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'train.png'}")
    print(f"checkpoints: {out / 'checkpoints'} (stalewise train CONFIG --resume {out})")
    if board is not None:
        print(f"tensorboard: {loggers[0].logdir} (tensorboard --logdir {board})")
    lost = [e for e in result.failures if "checkpoint" in e and e.get("final")]
    if lost:  # the metrics are saved; the run's end is not in its checkpoints
        e = lost[-1]
        print(
            _one_line(
                f"stalewise: the final checkpoint could not be written to {e['checkpoint']}: "
                f"{e['cause']} ({e['action']}); the metrics are in {out / 'metrics.jsonl'}"
            ),
            file=sys.stderr,
        )
        return 1
    return 0


def _sweep_values(args: argparse.Namespace) -> list[Any]:
    """--values as worker counts, consistency names or strategy names, each checked."""
    from stalewise import config, sweep

    values: list[Any] = []
    for v in (v.strip() for v in args.values.split(",")):
        if args.over == "workers":
            try:
                n = int(v)
            except ValueError:
                raise _config_error(
                    "--values",
                    f"expected worker counts such as 1,4,16, got {v!r} in {args.values!r} "
                    "(to compare consistency models: --over consistency --values asp,ssp:4,bsp)",
                ) from None
            limit = config.max_workers("sim")
            if not 1 <= n <= limit:
                raise _config_error(
                    "--values", f"worker counts must be in 1..{limit}, got {n} in {args.values!r}"
                )
            values.append(n)
        elif args.over == "strategy":
            try:
                config.parse_strategy_value(v)
            except ValueError as e:
                raise _config_error("--values", f"{e} in {args.values!r}") from None
            values.append(v)
        else:
            try:
                sweep.parse_consistency(v)
            except ValueError:
                raise _config_error(
                    "--values",
                    f"expected consistency models such as asp,ssp:4,bsp, got {v!r} "
                    f"in {args.values!r}",
                ) from None
            values.append(v)
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise _config_error("--values", f"{twice!r} is given twice in {args.values!r}")
    return values


def cmd_sim(args: argparse.Namespace) -> int:
    from stalewise import config, report, sweep, targets
    from stalewise.options import Simulation

    values = _sweep_values(args)
    if not math.isfinite(args.target):
        raise _config_error("--target", f"expected a finite number, got {args.target!r}")
    try:
        goal = targets.Target(args.metric, args.target, args.mode)
    except ValueError as e:
        raise _config_error(
            "--metric", f"{e} (on the command line: --mode min or --mode max)"
        ) from None
    cfg = config.load(  # a sweep is simulated
        args.config, runtime="sim", codec=args.codec, pull_codec=args.pull_codec
    )
    try:
        if args.over == "workers":
            for n in values:
                cfg.check_workers(n, "sim", "--values")
        if args.over == "strategy":
            values = [(v, cfg.sweep_strategy(v)) for v in values]
        metrics = cfg.metrics()
    except config.ConfigError as e:
        if e.key.startswith(("run.", "sim.", "task")):
            e.path = args.config
        raise
    if goal.metric not in metrics:
        raise _config_error(
            "--metric",
            f"expected a metric of the task's evaluate() ({', '.join(metrics)}), "
            f"got {goal.metric!r}",
        )
    out = _out_dir(args.out, f"sim-{Path(args.config).stem}")
    with cfg.importable():
        rows = sweep.sweep(
            cfg.job,
            cfg.seeded_task(),
            over=args.over,
            values=values,
            steps=cfg.train["steps"],
            target=goal.value,
            metric=goal.metric,
            mode=goal.mode,
            workers=cfg.train["workers"],
            sim=Simulation(cfg.sim, seed=cfg.seed),  # the task's seed seeds the simulator
            delay=cfg.delay,
            out=out,
            progress=not args.quiet,
        )
    print(report.format_table(rows, list(sweep.COLUMNS)))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'sweep.png'}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from stalewise import calibrate, config

    if not calibrate.MIN_REPEATS <= args.repeats <= calibrate.MAX_REPEATS:
        limits = f"{calibrate.MIN_REPEATS}..{calibrate.MAX_REPEATS}"
        raise _config_error("--repeats", f"expected an integer in {limits}, got {args.repeats}")
    out = None
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise _config_error("--out", f"{args.out!r} is a folder, expected a file name")
        _make_dir(out.parent, "--out", str(out.parent))
    if args.workers is not None and args.workers < 1:
        raise _config_error("--workers", f"expected an integer >= 1, got {args.workers}")
    cfg = config.load(args.config)
    workers = cfg.train["workers"] if args.workers is None else args.workers
    cfg.check_workers(workers, "local", "--workers" if args.workers is not None else "run.workers")
    with cfg.importable():
        cal = cfg.job.calibrate(
            cfg.task.loss_and_grad, cfg.data, workers=workers, repeats=args.repeats,
            delays=cfg.delay, evaluate=cfg.task.evaluate,
            eval_interval=cfg.train["metrics"].every, runtime=args.runtime,
        )  # fmt: skip
    text = cal.toml()
    if out is None:
        print(text, end="")
        return 0
    try:
        out.write_text(text)
    except OSError as e:
        raise _config_error("--out", f"cannot write {args.out!r}: {e.strerror or e}") from None
    print(cal.summary())
    print(
        f"\n[sim] table written to {out} (paste it into the config, or run stalewise sim with it)"
    )
    return 0


CODEC_HELP = "override server.codec: none, fp16, bf16, int8, sign or topk:FRACTION"
PULL_CODEC_HELP = (
    "override server.pull_codec (delta pulls, runtime sim): a codec as for --codec, "
    "or full (every pull the whole model)"
)


def build_parser() -> argparse.ArgumentParser:
    from stalewise import __version__, runtime

    parser = _Parser(prog="stalewise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stalewise {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo", help="synchronous vs asynchronous training of a digits MLP, with a straggler"
    )
    d.add_argument("--out", help="run folder (default: runs/demo-TIMESTAMP)")
    d.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    d.add_argument(
        "--slowdown", type=float, default=4.0, help="how many times slower the last worker is"
    )
    d.add_argument("--delay", type=float, default=0.008, help="emulated compute seconds per step")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="run a job described by a TOML config (see stalewise.config)")
    t.add_argument("config", help="path to CONFIG.toml")
    t.add_argument("--out", help="run folder (default: runs/CONFIG-TIMESTAMP)")
    t.add_argument("--runtime", help="override run.runtime: local, sim or ray")
    t.add_argument(
        "--address",
        help="with --runtime ray: the Ray cluster, e.g. auto (this machine's, from ray start) "
        "or HOST:PORT of its head node (default: run.address, else RAY_ADDRESS, else a new "
        "local instance)",
    )
    t.add_argument("--codec", help=CODEC_HELP)
    t.add_argument("--pull-codec", help=PULL_CODEC_HELP)
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint (steps stays the total budget)",
    )
    t.add_argument(
        "--checkpoint-every",
        type=_updates,
        metavar="N",
        help="also checkpoint every N pushes of the job (a checkpoint is always written at the end)",
    )
    t.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard scalars to DIR/<run folder name> (needs tensorboardX)",
    )
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser(
        "sim", help="simulate one config over worker counts, consistency models or strategies"
    )
    s.add_argument("config", help="path to CONFIG.toml (its [sim] table sets the timing model)")
    s.add_argument("--over", choices=("workers", "consistency", "strategy"), default="workers")
    s.add_argument("--codec", help=CODEC_HELP)
    s.add_argument("--pull-codec", help=PULL_CODEC_HELP)
    s.add_argument(
        "--values",
        required=True,
        help="comma-separated: 1,4,16 or asp,ssp:4,bsp or gradients,local_sgd:8,diloco:20 "
        "(NAME:H = H local steps per push; the other options come from the config's "
        "[strategy] table)",
    )
    s.add_argument("--metric", default="loss", help="metric of the task's evaluate() to reach")
    s.add_argument("--target", type=float, required=True, help="value of the metric to reach")
    s.add_argument(
        "--mode",
        choices=("min", "max"),
        default=None,
        help="min for a loss, max for accuracy (default: inferred from --metric's name)",
    )
    s.add_argument("--out", help="run folder (default: runs/sim-CONFIG-TIMESTAMP)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_sim)

    c = sub.add_parser(
        "calibrate",
        help="measure this machine's compute, pull/push and apply times for a config's job "
        "and write the simulator's [sim] table",
    )
    c.add_argument("config", help="path to CONFIG.toml (its task, job and run.workers/delay)")
    c.add_argument("--out", help="write the [sim] table to this file (default: stdout)")
    c.add_argument(
        "--workers", type=int, help="processes that compute at once (default: run.workers)"
    )
    c.add_argument(
        "--repeats", type=int, default=30, help="timed steps per worker and pushes per size"
    )
    c.add_argument(
        "--runtime",
        choices=("local", "ray"),
        default="local",
        help="the runtime whose pulls, pushes, shard and worker loop are timed (ray: the "
        "cluster RAY_ADDRESS names, else a new local instance)",
    )
    c.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "replay",
        help="replay a run's checkpoint and the push logs after it into its parameters",
        description="Loads RUN_DIR's newest checkpoint (or --from's), replays the push logs "
        "its shards wrote after it (local runtime, with a checkpoint folder), and says the "
        "parameters reached (docs/design-notes.md, 'Push log'). CONFIG is the run's: the "
        "optimizer is code, which a checkpoint does not hold.",
    )
    p.add_argument("config", help="the run's TOML config")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder, or its checkpoint folder")
    p.add_argument("--from", dest="start", metavar="CKPT", help="replay from this ckpt-* folder")
    p.add_argument("--out", metavar="FILE", help="write the parameters here (safetensors)")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare with the newest checkpoint's parameters (the run's final ones): "
        "identical, or the first leaf that differs (exit 1)",
    )
    p.set_defaults(func=cmd_replay)

    r = sub.add_parser(
        "run",
        help="run a training script you own once per worker (it calls sw.init(job))",
        description="Runs SCRIPT until it calls sw.init(job), serves that job, then runs "
        "SCRIPT once per worker process, each with its rank, world size and client "
        "(see stalewise.launch).",
    )
    r.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    r.add_argument(
        "--steps", type=int, help="the job's budget: pushes in all (ctx.should_stop() after it)"
    )
    r.add_argument(
        "--runtime",
        choices=runtime.names("launch"),
        default="local",
        help="local: worker processes on this machine (default); ray: Ray actors across the "
        "cluster (--address, else RAY_ADDRESS, else a new local instance)",
    )
    r.add_argument(
        "--address",
        help="--runtime ray: the Ray cluster, 'auto' (the one you started on this machine with "
        "ray start) or HOST:PORT of its head node (default: RAY_ADDRESS, else a new local "
        "instance, never another user's cluster on this machine)",
    )
    r.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="--runtime ray: give each rank this variable of this environment (repeatable); "
        "each gets STALEWISE_*, torchrun's and the thread counts' without it",
    )
    r.add_argument(
        "--env-all",
        action="store_true",
        help="--runtime ray: give each rank every variable of this environment but this "
        "machine's session and those named like credentials (--env NAME for one of those)",
    )
    r.add_argument(
        "--timeout",
        type=float,
        help="seconds for the whole run; then the ranks still running are named and stopped, "
        "exit 1 (default: none)",
    )
    r.add_argument(
        "--rank-timeout",
        type=float,
        help="seconds without a push, once a rank has pushed, while the other ranks push, "
        "before the rank is taken for hung, named and killed; exit 1 at the end (default "
        "300; 0: off; local runtime only)",
    )
    r.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the job (the shards' state, each rank's ctx.state) into DIR at the end "
        "and every --checkpoint-every pushes (local runtime only)",
    )
    r.add_argument(
        "--checkpoint-every",
        type=_updates,
        metavar="N",
        help="a checkpoint every N pushes of the job",
    )
    r.add_argument(
        "--resume",
        action="store_true",
        help="continue from DIR's last checkpoint (none yet: start from the start)",
    )
    r.add_argument(
        "--name",
        help="serve the job under this name: another process joins it with sw.attach(NAME) "
        "(room for --workers more worker ids)",
    )
    r.add_argument("script", help="the training script (python file)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    r.set_defaults(func=cmd_run)
    return parser


def cmd_replay(args: argparse.Namespace) -> int:
    import hashlib

    from stalewise import checkpoint, config
    from stalewise.checkpoint import replay

    cfg = config.load(args.config)
    root = Path(args.run_dir)
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    flat, ckpt, logs = replay.replay(root, cfg.job.config, args.start)
    digest = hashlib.sha256(flat.tobytes()).hexdigest()[:16]
    print(f"replayed {ckpt.path.name} and {len(logs)} push logs: params sha256 {digest}...")
    if args.out is not None:
        from safetensors.numpy import save_file

        leaves = {
            x.name: flat[x.offset : x.offset + x.size].reshape(x.shape) for x in ckpt.spec.leaves
        }
        save_file(leaves, args.out)
        print(f"params: {args.out}")
    if args.check:
        newest = checkpoint.load(root)
        leaf = replay.first_difference(flat, newest)
        print(
            f"{'identical to' if leaf is None else f'leaf {leaf!r} differs from'} {newest.path.name}"
        )
        return 0 if leaf is None else 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from stalewise import launch

    try:
        return launch.launch(
            args.script,
            args.args,
            workers=args.workers,
            steps=args.steps,
            runtime=args.runtime,
            timeout=args.timeout,
            rank_timeout=args.rank_timeout,
            address=args.address,
            env=args.env,
            env_all=args.env_all,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            name=args.name,
        )
    except launch.LaunchError as e:
        print(f"stalewise: run: {_one_line(e)}", file=sys.stderr)
        return 2
    except launch.Terminated:  # SIGTERM: the job was stopped as for Ctrl-C
        print("stalewise: run: terminated (SIGTERM); the job was stopped", file=sys.stderr)
        return 143


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for a user error, on one line of stderr)."""
    try:
        args = build_parser().parse_args(argv)
    except _FlagError as e:
        message = str(e).removeprefix("argument ")
        print(f"stalewise: {_one_line(message)}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from stalewise.checkpoint import CheckpointError
    from stalewise.config import ConfigError
    from stalewise.protocol.notices import FailureWarning
    from stalewise.runtime.errors import DivergedError
    from stalewise.runtime.sim.config import TooLongError

    try:
        with warnings.catch_warnings():
            # a FailureWarning's event is also logged at WARNING, which the CLI shows: once
            warnings.filterwarnings("ignore", category=FailureWarning)
            return args.func(args)
    except ConfigError as e:
        where = f"config error in {e.path}" if e.path is not None else "config error"
        print(f"stalewise: {_one_line(f'{e.key}: {e.problem}')} ({where})", file=sys.stderr)
        return 2
    except TooLongError as e:  # a simulated run of a sweep (stalewise sim) too long to record
        where = f"config error in {args.config}" if hasattr(args, "config") else "config error"
        print(f"stalewise: sim: {_one_line(str(e))} ({where})", file=sys.stderr)
        return 2
    except DivergedError as e:  # the run's result (its message says why and what to change)
        print(f"stalewise: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except CheckpointError as e:  # --resume from none that may be used
        print(f"stalewise: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stalewise: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (``stalewise sim ... | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
