"""A plain PyTorch loop, launched as a 4-worker asynchronous job with ``stalewise run``.

``train_plain`` is an ordinary single-process loop. ``train`` is the same loop
for ``stalewise run``, which runs this file once per worker process: the
optimizer moves to the parameter server (``sw.Job``), ``sw.init`` gives each
process its rank, its client and the job's budget, and each step pulls the
global weights and pushes its gradients instead of ``opt.step()``::

    .venv/bin/stalewise run --workers 4 --steps 400 examples/torch_launch.py
    .venv/bin/python examples/torch_launch.py          # unlaunched: one worker
    .venv/bin/python examples/torch_launch.py --plain  # the plain loop
"""

import sys

import torch
from sklearn.datasets import load_digits

import stalewise as sw

STEPS = 400


def make_model():
    torch.manual_seed(0)  # the same initial model in every process
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))


def load_data():
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train_plain():
    model, (x, y) = make_model(), load_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        idx = torch.randint(len(x), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return accuracy(model, x, y)


def train():
    model, (x, y) = make_model(), load_data()
    ctx = sw.init(sw.Job(model, optimizer=sw.optim.adam(1e-2)), steps=STEPS)
    gen = torch.Generator().manual_seed(ctx.rank)
    while not ctx.should_stop():
        ctx.client.pull(into=model)
        idx = torch.randint(len(x), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        model.zero_grad()
        loss.backward()
        ctx.client.push({n: p.grad for n, p in model.named_parameters()})
    ctx.client.pull(into=model)
    return accuracy(model, x, y), ctx


if __name__ == "__main__":
    if "--plain" in sys.argv:
        print(f"plain loop: training accuracy {train_plain():.3f}")
    else:
        acc, ctx = train()
        # one write per line: the workers share the launcher's stdout
        sys.stdout.write(f"rank {ctx.rank} of {ctx.world_size}: training accuracy {acc:.3f}\n")
        sys.stdout.flush()
        ctx.close()
