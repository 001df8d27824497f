"""Train the small GPT of model.py on Python's own source (the README's walkthrough).

    python examples/gpt/train.py                              # one process
    stalewise run --workers 4 examples/gpt/train_launched.py  # 4 asynchronous workers
    stalewise run --workers 4 --checkpoint-dir ckpt --resume examples/gpt/train_launched.py
    python examples/gpt/train_launched.py                     # unlaunched: one worker

train_launched.py is train.py with the optimizer on stalewise's server: each
worker pulls the global weights, pushes its gradient, and the server applies
AdamW. ``diff -u train.py train_launched.py`` is the whole change.

Like a torchrun-ready script, train.py reads its rank from ``RANK`` (0 when run
alone; ``stalewise run`` sets it in each rank, as torchrun does): it seeds its
batches with it and names its output in ``OUT_DIR`` (default ``out-gpt``) after
it, so ranks never write over each other. The batches' position is the generator
``gen``; train_launched.py keeps its state in ``ctx.state``, which
``stalewise run --checkpoint-dir DIR`` saves with the server's weights and
optimizer state, and ``--resume`` restores (the same command for the first
launch and every restart; local runtime only: ``--runtime ray`` refuses
``--checkpoint-dir``). ``ctx.loop(into=model)`` pulls the global weights into
the model before each step and once more at the end.
"""

import os
from pathlib import Path

import torch
from data import estimate_loss, get_batch, load_text
from model import GPT, GPTConfig

import stalewise as sw

STEPS, BATCH, LR = 400, 16, 3e-3
RANK = int(os.environ.get("RANK", 0))  # torchrun's convention: 0 in a single process
OUT_DIR = Path(os.environ.get("OUT_DIR", "out-gpt"))  # one file per rank in it


def main():
    torch.manual_seed(1337)  # the same initial model in every process
    cfg = GPTConfig()
    train, val = load_text()
    model = GPT(cfg)
    print(f"val loss {estimate_loss(model, val):.3f} at init", flush=True)
    ctx = sw.init(sw.Job(model, optimizer=sw.optim.adamw(LR), consistency=sw.BSP()), steps=STEPS)
    gen = torch.Generator().manual_seed(1337 + RANK)  # this rank's batches (its data position)
    if "gen" in ctx.state:  # resumed (stalewise run --resume): where this rank's batches were
        gen.set_state(torch.from_numpy(ctx.state["gen"]))
    for _ in ctx.loop(into=model):  # pulls the job's weights before each step, and at the end
        x, y = get_batch(train, BATCH, cfg.block_size, gen)
        ctx.state["gen"] = gen.get_state().numpy()  # saved with each checkpoint
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        ctx.client.push({n: p.grad for n, p in model.named_parameters()})
    print(f"rank {RANK}: val loss {estimate_loss(model, val):.3f}", flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), OUT_DIR / f"model_rank{RANK}.pt")


if __name__ == "__main__":
    main()
