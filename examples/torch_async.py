"""A plain PyTorch training loop, made a 4-worker asynchronous job.

The single-process loop (``train_plain``) is ordinary PyTorch: a module, a loss,
a torch optimizer. ``train_async`` is the same loop run by 4 worker processes;
the lines marked ``# stalewise`` are all that changed: the optimizer moves to the
parameter server, each worker pulls the global weights into its module before
a step and pushes its gradients after it.

    .venv/bin/python examples/torch_async.py
"""

import multiprocessing as mp

import torch
from sklearn.datasets import load_digits

import stalewise as sw

WORKERS, STEPS = 4, 300


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
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS // WORKERS):
        client.pull(into=model)  # stalewise: fetch the global weights
        idx = torch.randint(len(x), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        model.zero_grad()
        loss.backward()
        client.push({n: p.grad for n, p in model.named_parameters()})  # stalewise: not opt.step()
    client.close()


def train_async():
    model, (x, y) = make_model(), load_data()
    job = sw.Job(model, optimizer=sw.optim.adam(1e-2), consistency=sw.SSP(2))  # stalewise
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
    print(f"4 async workers:     training accuracy {train_async():.3f}")
