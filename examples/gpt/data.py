"""The text: Python's own standard-library source, read as bytes (offline on every machine).

``load_text()`` concatenates a fixed list of standard-library modules (about
0.7 MB; the files differ a little between Python versions, and so do the
losses), holds out the last 10% for validation, and returns both as tensors of
byte values (the tokens); ``get_batch`` draws random windows, ``estimate_loss``
scores a fixed, evenly spaced set of validation windows (the same figures on
every call).
"""

import sysconfig
from pathlib import Path

import torch

FILES = ("argparse", "ast", "dataclasses", "difflib", "inspect", "pickle", "tarfile", "typing")


def load_text(val_fraction=0.1):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / f"{name}.py").read_bytes() for name in FILES)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n_val = int(len(data) * val_fraction)
    return data[:-n_val], data[-n_val:]  # train, val


def get_batch(data, batch_size, block_size, gen):
    """``batch_size`` random windows: inputs, and the same shifted by one byte."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + block_size] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts])
    return x, y


@torch.no_grad()
def estimate_loss(model, data, windows=64):
    block_size = model.cfg.block_size
    starts = torch.linspace(0, len(data) - block_size - 1, windows).long()
    x = torch.stack([data[s : s + block_size] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts])
    return model(x, y)[1].item()
