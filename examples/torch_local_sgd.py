"""A plain PyTorch training loop, made a 4-worker local-SGD job.

The single-process loop (``train_plain``) is ordinary PyTorch: a module, a loss,
a torch optimizer. ``train_local_sgd`` is the same loop run by 4 worker
processes; the lines marked ``# stalewise`` are all that changed. Each worker
keeps its own optimizer and takes ``EVERY`` local steps; then ``sw.LocalSGD``
(hooked on ``opt.step()``) pushes how far the worker moved and pulls the global
weights into its module. Under BSP the server applies the mean of a round's
moves with ``sgd(1.0)``: FedAvg. For DiLoCo, give the Job DiLoCo's outer
optimizer instead (``optimizer=sw.optim.sgd(0.7, momentum=0.9, nesterov=True)``)
and the workers ``torch.optim.AdamW``.

    .venv/bin/python examples/torch_local_sgd.py
"""

import multiprocessing as mp

import torch
from sklearn.datasets import load_digits

import stalewise as sw

WORKERS, STEPS, EVERY = 4, 300, 10


def make_model():
    torch.manual_seed(0)
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


def worker(client, rank):  # the same loop, in one of 4 processes
    model, (x, y) = make_model(), load_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    with sw.LocalSGD(client, model, opt, local_steps=EVERY):  # stalewise: sync every EVERY steps
        for _ in range(STEPS // WORKERS):
            idx = torch.randint(len(x), (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    client.close()  # stalewise


def train_local_sgd():
    model, (x, y) = make_model(), load_data()
    job = sw.Job(model, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())  # stalewise
    with job.serve(workers=WORKERS) as server:  # stalewise
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(server.client(r), r)) for r in range(WORKERS)]
        for r, p in enumerate(procs):
            p.start()
            server.release(r)  # stalewise: the shards now notice if this worker dies
        for p in procs:
            p.join()
        server.pull(into=model)  # stalewise: the trained weights
    return accuracy(model, x, y)


if __name__ == "__main__":
    print(f"plain loop:          training accuracy {train_plain():.3f}")
    print(f"4 local-SGD workers: training accuracy {train_local_sgd():.3f}")
