"""A small byte-level GPT on the Python standard library's own source (PyTorch): one token
per byte, parameters a nested dict of CPU float32 tensors. The corpus (:data:`CORPUS_MODULES`,
nothing downloaded), its held-out split, the model and its sizes: docs/lm.md."""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from stalewise.tasks import base
from stalewise.tasks.base import check_int, check_memory, check_number, fields_repr, shard_batches

logger = logging.getLogger(__name__)

__all__ = ["CORPUS_MODULES", "SIZES", "Corpus", "LanguageModel", "load_corpus"]

VOCAB = 256

#: The standard-library modules whose source makes the corpus, in this order.
# fmt: off
CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "dis", "enum", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "hmac", "html",
    "inspect", "ipaddress", "json", "json.decoder", "json.encoder", "keyword", "linecache",
    "locale", "logging", "mailbox", "numbers", "operator", "optparse", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "secrets", "selectors", "shlex", "shutil", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "token", "tokenize", "trace", "traceback", "turtle", "typing", "uuid", "warnings", "wave",
    "weakref", "zipfile",
)
# fmt: on

#: Model sizes: ``size=`` picks one; ``dim=``, ``layers=``, ``heads=`` override its fields.
SIZES = {
    "tiny": {"dim": 32, "layers": 1, "heads": 2},
    "small": {"dim": 64, "layers": 2, "heads": 4},
    "base": {"dim": 128, "layers": 4, "heads": 4},
    "medium": {"dim": 128, "layers": 6, "heads": 4},  # 1.23 M parameters at context 64
}


class Corpus(NamedTuple):
    """The corpus as read-only uint8 arrays, split into training and held-out bytes."""

    train: np.ndarray  # the first (1 - val_fraction) of the bytes
    val: np.ndarray  # the last val_fraction of the bytes
    sha256: str  # of train + val, the whole corpus
    files: tuple[str, ...]  # the files read, relative to the stdlib folder


def _module_file(stdlib: str, module: str) -> str:
    """``a.b`` -> ``a/b.py`` or ``a/b/__init__.py`` (whichever this Python has)."""
    stem = module.replace(".", "/")
    for rel in (stem + ".py", stem + "/__init__.py"):
        if os.path.isfile(os.path.join(stdlib, rel)):
            return rel
    raise FileNotFoundError(
        f"corpus module {module!r}: no {stem}.py nor {stem}/__init__.py in {stdlib}"
    )


@functools.lru_cache(maxsize=4)
def load_corpus(corpus_bytes: int = 1 << 21, val_fraction: float = 0.05) -> Corpus:
    """Reads the corpus, up to ``corpus_bytes``, the last ``val_fraction`` held out
    (cached per process).

    Example:
        >>> c = load_corpus(100_000, 0.1)
        >>> len(c.train), len(c.val), c.files[0]
        (90000, 10000, 'abc.py')
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks, files, size = [], [], 0
    for module in CORPUS_MODULES:
        if size >= corpus_bytes:
            break
        rel = _module_file(stdlib, module)
        with open(os.path.join(stdlib, rel), "rb") as f:
            chunks.append(f.read() + b"\0")
        files.append(rel)
        size += len(chunks[-1])
    data = np.frombuffer(b"".join(chunks)[:corpus_bytes], dtype=np.uint8)
    n_val = round(len(data) * val_fraction)
    train, val = data[: len(data) - n_val].copy(), data[len(data) - n_val :].copy()
    for a in (train, val):
        a.setflags(write=False)
    sha = hashlib.sha256(data.tobytes()).hexdigest()
    logger.debug("lm corpus: %d bytes from %d files, sha256 %s", len(data), len(files), sha)
    return Corpus(train, val, sha, tuple(files))


class LanguageModel:
    """A byte-level GPT on standard-library source (docs/lm.md).

    Batches are int64 tensors ``(batch_size, context + 1)`` of bytes: the model reads ``[:, :-1]``
    and predicts ``[:, 1:]``; the loss is the mean cross-entropy per byte, in nats. ``size`` is one
    of :data:`SIZES`; ``dim``, ``layers`` and ``heads`` override it; ``vocab`` (>= 256) widens the
    tied embedding and head (GPT-2's 50304: rows past 255 are never a byte).

    Example:
        >>> task = LanguageModel(size="tiny", context=16, batch_size=4, corpus_bytes=50_000)
        >>> params = task.init_params(seed=0)
        >>> loss, grads = task.loss_and_grad(params, next(task.batches(0, 2)))
        >>> abs(loss - math.log(256)) < 0.1, grads["wte"].shape
        (True, torch.Size([256, 32]))
        >>> sorted(task.evaluate(params))
        ['loss', 'perplexity']
    """

    name = "lm"

    def __init__(
        self,
        size: str = "tiny",
        context: int = 64,
        batch_size: int = 16,
        dim: int | None = None,
        layers: int | None = None,
        heads: int | None = None,
        corpus_bytes: int = 1 << 21,
        val_fraction: float = 0.05,
        eval_windows: int = 64,
        vocab: int = VOCAB,
    ) -> None:
        if size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
        shape = dict(SIZES[size])
        for key, value in (("dim", dim), ("layers", layers), ("heads", heads)):
            if value is not None:
                shape[key] = check_int(key, value)
        if shape["dim"] % shape["heads"]:
            raise ValueError(f"dim={shape['dim']} is not a multiple of heads={shape['heads']}")
        self.size = size
        self.dim, self.layers, self.heads = shape["dim"], shape["layers"], shape["heads"]
        self.context = check_int("context", context)
        self.batch_size = check_int("batch_size", batch_size)
        self.corpus_bytes = check_int("corpus_bytes", corpus_bytes)
        self.val_fraction = check_number("val_fraction", val_fraction, 0.0, 1.0, open_="both")
        self.eval_windows = check_int("eval_windows", eval_windows)
        self.vocab = check_int("vocab", vocab, VOCAB)
        check_memory(
            self.name,
            self.memory_bytes(),
            {k: (shape[k], SIZES[size][k]) for k in shape}
            | {"context": (self.context, 64), "batch_size": (self.batch_size, 16)}
            | {"eval_windows": (self.eval_windows, 64), "vocab": (self.vocab, VOCAB)},
        )
        corpus = self.corpus  # reads the files once here, so a bad size fails at construction
        if len(corpus.val) < self.context + 1:
            raise ValueError(
                f"val_fraction={val_fraction}: {len(corpus.val)} held-out bytes, fewer than "
                f"context + 1 = {self.context + 1}"
            )
        if self.num_train < 1:
            raise ValueError(
                f"corpus_bytes={corpus_bytes}: no training window of context + 1 = "
                f"{self.context + 1} bytes fits"
            )

    def memory_bytes(self) -> int:
        """The bytes one process allocates for the model (float32): the parameters and their
        gradients, and the larger of a training batch's activations and the held-out windows'."""
        d, layers, ctx, vocab = self.dim, self.layers, self.context, self.vocab
        params = vocab * d + ctx * d + layers * (12 * d * d + 13 * d) + 2 * d
        token = 16 * d + 2 * self.heads * ctx
        train = self.batch_size * ctx * (layers * token + 3 * vocab)
        held_out = self.eval_windows * ctx * (token + 3 * vocab)
        return 4 * (3 * params + max(train, held_out))

    def __repr__(self) -> str:
        shown = ("size", "context", "batch_size", "dim", "layers", "heads", "corpus_bytes")
        return fields_repr(self, *shown, "val_fraction", "eval_windows", "vocab")

    @property
    def corpus(self) -> Corpus:
        """The corpus (read on first use, cached per process, never pickled)."""
        return load_corpus(self.corpus_bytes, self.val_fraction)

    @property
    def corpus_sha256(self) -> str:
        return self.corpus.sha256

    @property
    def num_train(self) -> int:
        """Number of training windows shared among the workers."""
        return (len(self.corpus.train) - 1) // self.context

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.context

    def train_window_starts(self) -> np.ndarray:
        """Start offsets (into the corpus) of the training windows."""
        return np.arange(self.num_train, dtype=np.int64) * self.context

    def eval_window_starts(self) -> np.ndarray:
        """Start offsets (into the corpus) of the held-out windows :meth:`evaluate` scores."""
        val, n_train_bytes = self.corpus.val, len(self.corpus.train)
        last = len(val) - (self.context + 1)
        count = min(self.eval_windows, last + 1)
        return n_train_bytes + np.linspace(0, last, count).round().astype(np.int64)

    def num_params(self) -> int:
        return sum(t.numel() for t in base.dict_leaves(self.init_params(0)))

    def init_params(self, seed: int = 0) -> dict:
        """Returns fresh float32 parameters, deterministic by ``seed``."""
        g = torch.Generator().manual_seed(seed)
        d, std = self.dim, 0.02
        resid = std / math.sqrt(2 * self.layers)

        def normal(*shape: int, s: float = std) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * s

        def ln() -> dict:
            return {"w": torch.ones(d), "b": torch.zeros(d)}

        def linear(fan_in: int, fan_out: int, s: float = std) -> dict:
            return {"w": normal(fan_in, fan_out, s=s), "b": torch.zeros(fan_out)}

        params: dict = {"wte": normal(self.vocab, d), "wpe": normal(self.context, d), "blocks": {}}
        for i in range(self.layers):
            params["blocks"][str(i)] = {
                "ln1": ln(),
                "attn": {"qkv": linear(d, 3 * d), "proj": linear(d, d, resid)},
                "ln2": ln(),
                "mlp": {"fc": linear(d, 4 * d), "proj": linear(4 * d, d, resid)},
            }
        params["ln_f"] = ln()
        return params

    def batches(self, worker: int, workers: int, seed: int = 0) -> Iterator[torch.Tensor]:
        """Yields ``worker``'s ``(batch_size, context + 1)`` int64 windows forever."""
        train = self.corpus.train
        starts = self.train_window_starts()
        offsets = np.arange(self.context + 1)
        for idx in shard_batches(len(starts), self.batch_size, worker, workers, seed):
            yield torch.from_numpy(train[starts[idx, None] + offsets].astype(np.int64))

    def logits(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """The next-byte logits ``(B, T, vocab)`` of inputs ``x`` ``(B, T)``, ``T <= context``."""
        b, t = x.shape
        h = params["wte"][x] + params["wpe"][:t]
        heads, d = self.heads, self.dim
        for i in range(self.layers):
            blk = params["blocks"][str(i)]
            a = F.layer_norm(h, (d,), blk["ln1"]["w"], blk["ln1"]["b"])
            qkv = a @ blk["attn"]["qkv"]["w"] + blk["attn"]["qkv"]["b"]
            q, k, v = qkv.view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, d)
            h = h + y @ blk["attn"]["proj"]["w"] + blk["attn"]["proj"]["b"]
            m = F.layer_norm(h, (d,), blk["ln2"]["w"], blk["ln2"]["b"])
            m = F.gelu(m @ blk["mlp"]["fc"]["w"] + blk["mlp"]["fc"]["b"])
            h = h + m @ blk["mlp"]["proj"]["w"] + blk["mlp"]["proj"]["b"]
        h = F.layer_norm(h, (d,), params["ln_f"]["w"], params["ln_f"]["b"])
        return h @ params["wte"].T

    def _loss(self, params: dict, batch: torch.Tensor) -> torch.Tensor:
        logits = self.logits(params, batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].reshape(-1))

    def loss_and_grad(self, params: dict, batch: torch.Tensor) -> tuple[float, dict]:
        """Returns the mean cross-entropy per byte of ``batch`` and its gradient (autograd)."""
        leaves = base.map_dict(lambda t: t.detach().requires_grad_(True), params)
        loss = self._loss(leaves, batch)
        grads = iter(torch.autograd.grad(loss, base.dict_leaves(leaves)))
        return float(loss.detach()), base.map_dict(lambda _: next(grads), leaves)

    def evaluate(self, params: dict) -> dict[str, float]:
        """Returns the held-out ``loss`` (nats per byte) and ``perplexity`` (per byte)."""
        corpus = self.corpus
        starts = self.eval_window_starts() - len(corpus.train)
        windows = corpus.val[starts[:, None] + np.arange(self.context + 1)].astype(np.int64)
        with torch.no_grad():
            p = base.map_dict(lambda t: torch.as_tensor(t, dtype=torch.float32), params)
            loss = float(self._loss(p, torch.from_numpy(windows)))
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
