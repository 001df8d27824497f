"""Train the small GPT of model.py on Python's own source (the README's walkthrough).

    python examples/gpt/train.py                              # one process
    stalewise run --workers 4 examples/gpt/train_launched.py  # 4 asynchronous workers
    python examples/gpt/train_launched.py                     # unlaunched: one worker

train_launched.py is train.py with the optimizer on stalewise's server: each
worker pulls the global weights, pushes its gradient, and the server applies
AdamW. ``diff -u train.py train_launched.py`` is the whole change.
"""

import torch
from data import estimate_loss, get_batch, load_text
from model import GPT, GPTConfig

STEPS, BATCH, LR = 400, 16, 3e-3


def main():
    torch.manual_seed(1337)  # the same initial model in every process
    cfg = GPTConfig()
    train, val = load_text()
    model = GPT(cfg)
    print(f"val loss {estimate_loss(model, val):.3f} at init", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1337)
    for _ in range(STEPS):
        x, y = get_batch(train, BATCH, cfg.block_size, gen)
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"val loss {estimate_loss(model, val):.3f}", flush=True)


if __name__ == "__main__":
    main()
