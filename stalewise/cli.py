"""The ``stalewise`` command: ``demo``, ``train CONFIG.toml``, ``sim CONFIG.toml``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("stalewise")


def _out_dir(arg: str | None, prefix: str) -> Path:
    out = Path(arg) if arg else Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    from stalewise import demo

    out = _out_dir(args.out, "demo")
    rows = demo.run(
        out, workers=args.workers, slowdown=args.slowdown, delay=args.delay, progress=not args.quiet
    )
    print(demo.summary(rows))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'demo.png'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from stalewise import config, report

    cfg = config.load(args.config)
    train = cfg.train_kwargs(args.runtime)
    out = _out_dir(args.out, Path(args.config).stem)
    run = Path(args.config).stem
    with report.MetricsWriter(out / "metrics.jsonl") as writer:
        result = cfg.job.train(
            cfg.task.loss_and_grad,
            data=cfg.task.batches,
            evaluate=cfg.task.evaluate,
            run=run,
            on_record=writer.write,
            progress=not args.quiet,
            **train,
        )
    report.plot_runs(result.records, out / "train.png", title=run)
    last = result.records[-1] if result.records else {}
    row = {
        "run": run,
        "time_s": result.time,
        "pushes": result.pushes,
        **{k: last.get(k) for k in ("loss", "accuracy")},
    }
    row |= {k: result.stats.get(k) for k in ("staleness_mean", "staleness_max")}
    print(report.format_table([row], list(row)))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'train.png'}")
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from stalewise import config, report, sweep, targets

    try:
        goal = targets.Target(args.metric, args.target, args.mode)
    except ValueError as e:
        raise config.ConfigError(f"--metric/--target/--mode: {e}") from None
    cfg = config.load(args.config)
    try:
        values = [int(v) if args.over == "workers" else v for v in args.values.split(",")]
    except ValueError:
        raise config.ConfigError(
            f"--values: worker counts must be integers, got {args.values!r}"
        ) from None
    out = _out_dir(args.out, f"sim-{Path(args.config).stem}")
    rows = sweep.sweep(
        cfg.job,
        cfg.task,
        over=args.over,
        values=values,
        steps=cfg.train["steps"],
        target=goal.value,
        metric=goal.metric,
        mode=goal.mode,
        workers=cfg.train["workers"],
        sim=cfg.sim,
        delay=cfg.delay,
        seed=cfg.seed,
        out=out,
        progress=not args.quiet,
    )
    print(report.format_table(rows, list(sweep.COLUMNS)))
    print(f"\nmetrics: {out / 'metrics.jsonl'}\nplot:    {out / 'sweep.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from stalewise import __version__

    parser = argparse.ArgumentParser(prog="stalewise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stalewise {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo", help="synchronous vs asynchronous training of a digits MLP, with a straggler"
    )
    d.add_argument("--out", help="run folder (default: runs/demo-TIMESTAMP)")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument(
        "--slowdown", type=float, default=4.0, help="how many times slower the last worker is"
    )
    d.add_argument("--delay", type=float, default=0.008, help="emulated compute seconds per step")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="run a job described by a TOML config (see stalewise.config)")
    t.add_argument("config", help="path to CONFIG.toml")
    t.add_argument("--out", help="run folder (default: runs/CONFIG-TIMESTAMP)")
    t.add_argument("--runtime", help="override run.runtime: local or sim")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser(
        "sim", help="simulate one config over several worker counts or consistency models"
    )
    s.add_argument("config", help="path to CONFIG.toml (its [sim] table sets the timing model)")
    s.add_argument("--over", choices=("workers", "consistency"), default="workers")
    s.add_argument("--values", required=True, help="comma-separated: 1,4,16 or asp,ssp:4,bsp")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from stalewise.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"stalewise: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stalewise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
