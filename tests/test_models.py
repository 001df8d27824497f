"""Real models trained as local jobs: every framework's own model objects and pytrees.

Each test trains a small model with ``sw.Job(...).train(...)`` on 2 worker
processes of the local runtime, on scikit-learn's digits or synthetic tokens,
and checks that the *eval-mode* loss of the trained parameters fell: a torch
CNN with BatchNorm (whose running statistics must reach the server), GPT-2
from a tiny ``transformers`` config (tied embeddings), a flax nnx MLP with
BatchNorm, an equinox MLP, and a Keras 3 Sequential model on TensorFlow.

Worker processes import this module to find the functions below, so the
frameworks are imported inside them, not at the top.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import stalewise as sw
from stalewise import tree
from stalewise.optim.buffers import with_buffers
from stalewise.protocol import PushHeader, Shard
from stalewise.segments import Segments
from stalewise.tasks.base import shard_batches

TIMEOUT = 240.0  # wall seconds before a run is declared hung
WORKERS = 2
BATCH = 32

_MODELS: dict = {}  # one model per process and kind, built on first use


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 8x8 digits, raw pixels 0..16, float32."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.int64)
    return x[:1400], y[:1400], x[1400:], y[1400:]


def digit_batches(scale: float, per_worker: int = 40) -> list[list[tuple]]:
    """Each worker's minibatches ``(x * scale, y)`` as NumPy arrays (cycled by the runtime),
    made here so that the worker processes need not import scikit-learn."""
    x, y, _, _ = digits()
    shards = []
    for w in range(WORKERS):
        indices = itertools.islice(shard_batches(len(x), BATCH, w, WORKERS), per_worker)
        shards.append([(x[i] * scale, y[i]) for i in indices])
    return shards


def _cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of NumPy logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), float((logits.argmax(1) == y).mean())


# --- a torch CNN with BatchNorm -----------------------------------------------------------


def make_cnn():
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def cnn_loss_and_grad(params, batch):
    """The torch contract: load, step in train mode, return grads and the buffers' values."""
    import torch

    model = _MODELS.get("cnn") or _MODELS.setdefault("cnn", make_cnn())
    model.load_state_dict(params, strict=False)  # num_batches_tracked stays per worker
    model.train()
    model.zero_grad()
    x, y = (torch.from_numpy(a) for a in batch)
    loss = torch.nn.functional.cross_entropy(model(x.reshape(-1, 1, 8, 8)), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.item(), grads | dict(model.named_buffers())


def cnn_metrics(model, train_mode: bool) -> tuple[float, float]:
    import torch

    _, _, x, y = digits()
    model.train(train_mode)
    with torch.no_grad():
        logits = model(torch.from_numpy(x.reshape(-1, 1, 8, 8))).numpy()
    return _cross_entropy(logits, y)


CNN_STEPS = 240


def test_torch_cnn_with_batchnorm_keeps_its_running_statistics(no_leaks):
    """2 workers, ASP: the server keeps the BN statistics the workers report, so the pulled
    model is as good in eval mode as in train mode (before: eval loss 8.9 vs train 0.07)."""
    import torch

    model = make_cnn()
    # a decaying learning rate, as one trains for good running statistics at the end
    job = sw.Job(model, optimizer=sw.optim.adam(sw.optim.warmup_cosine(0.01, 20, CNN_STEPS)))
    spec = job.config.spec
    assert spec.buffers == (
        "1.running_mean",
        "1.running_var",
        "5.running_mean",
        "5.running_var",
    )
    assert "1.num_batches_tracked" not in spec.segments.names  # integer: per worker
    before = cnn_metrics(model, train_mode=False)
    result = job.train(
        cnn_loss_and_grad,
        data=digit_batches(1.0),  # raw pixels: far from BatchNorm's 0/1 start
        workers=WORKERS,
        steps=CNN_STEPS,
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    trained = make_cnn()
    tree.unflatten_into(trained, result.flat, spec)  # what server.pull(into=model) does
    assert not torch.equal(trained[1].running_var, torch.ones(8))
    assert int(trained[1].num_batches_tracked) == 0  # left alone
    loaded = make_cnn()
    loaded.load_state_dict(result.params, strict=False)  # the returned params, by name
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    eval_loss, eval_acc = cnn_metrics(trained, train_mode=False)
    _, train_acc = cnn_metrics(trained, train_mode=True)
    assert eval_loss < 0.5 * before[0], (before, eval_loss)
    assert eval_acc >= 0.8, (eval_acc, train_acc)
    assert abs(eval_acc - train_acc) <= 0.05, (eval_acc, train_acc)
    # what a pull gave before buffers travelled: the parameters with BN's initial statistics
    without = make_cnn()
    without.load_state_dict(
        {k: v for k, v in result.params.items() if "running" not in k}, strict=False
    )
    assert cnn_metrics(without, train_mode=False)[1] < eval_acc - 0.3


def test_a_state_dict_job_with_named_buffers_is_the_same_job():
    """``Job(model.state_dict())``: integer entries stay out of the vector, BatchNorm's
    running statistics are buffers, and a shard applies a push of the torch contract."""
    model = make_cnn()
    job = sw.Job(model.state_dict(), optimizer=sw.optim.adam(0.01))
    spec = job.config.spec
    like = sw.Job(model, optimizer=sw.optim.sgd(1.0)).config.spec
    assert spec.segments.names == like.segments.names and spec.buffers == like.buffers
    named = sw.Job(model.state_dict(), optimizer=sw.optim.sgd(1.0), buffers=r"\.running_mean$")
    assert named.config.spec.buffers == ("1.running_mean", "5.running_mean")  # as told
    params = tree.unflatten(job.config.init, spec)
    assert int(params["1.num_batches_tracked"]) == 0  # as it was: a constant
    _, update = cnn_loss_and_grad(params, digit_batches(1.0, 1)[0][0])
    assert int(update["1.num_batches_tracked"]) == 1  # in the update, and not read
    shard = job.config.build_shard(0, job.config.init.copy(), workers=1)
    shard.join(0, incarnation=1)
    assert shard.push(PushHeader(0, 0, 0, 1), tree.flatten(update, spec=spec)[0]).ok
    # rate 1: the server now holds the worker's running mean after its step
    pulled = tree.unflatten(shard.params, spec)
    np.testing.assert_allclose(pulled["1.running_mean"].numpy(), update["1.running_mean"].numpy())
    assert not np.allclose(pulled["0.weight"].numpy(), params["0.weight"].numpy())


# --- buffers on the server and in the strategies -----------------------------------------------

SEGMENTS = Segments.from_sizes(["w", "bn.mean"], [2, 1])


def _wrapped(inner: sw.optim.Optimizer) -> tuple:
    opt = with_buffers(inner, ["bn.mean"])
    params = np.array([1.0, 1.0, 10.0], np.float32)
    return opt, opt.init(params, SEGMENTS), params


def test_the_server_moves_buffers_toward_the_reported_values():
    opt, state, params = _wrapped(sw.optim.sgd(0.5))
    report = np.array([2.0, -2.0, 4.0], np.float32)
    updates, _ = opt.update(report.copy(), state, params)
    opt.apply(report.copy(), state, params, scale=1.0)
    assert params.tolist() == [0.0, 2.0, 4.0]  # w: SGD; bn.mean: the report
    np.testing.assert_array_equal(np.array([1.0, 1.0, 10.0]) + updates, params)
    opt.apply(np.array([0.0, 0.0, 8.0], np.float32), state, params, scale=0.25)
    assert params[2] == 5.0  # a stale report (staleness weight 0.25) moves it a quarter
    half = with_buffers(sw.optim.sgd(0.5), ["bn.mean"], rate=0.5)
    p = np.array([0.0, 0.0, 10.0], np.float32)
    half.apply(np.array([0.0, 0.0, 4.0], np.float32), half.init(p, SEGMENTS), p)
    assert p[2] == 7.0
    with pytest.raises(ValueError, match=r"rate must be in \(0, 1\]"):
        with_buffers(sw.optim.sgd(0.5), ["bn.mean"], rate=0.0)
    again = with_buffers(opt, ["bn.mean"])  # re-wrapped, not wrapped twice
    assert not isinstance(again.apply.__self__.inner.apply.__self__, type(opt.apply.__self__))


def test_buffer_reports_are_no_gradients_for_the_optimizer():
    # a huge report does not count for the clipping norm and leaves Adam no moments
    opt, state, params = _wrapped(
        sw.optim.chain(sw.optim.clip_by_global_norm(1.0), sw.optim.adam(0.1))
    )
    opt.apply(np.array([3.0, 4.0, 1e6], np.float32), state, params)
    assert params[2] == 1e6
    adam = state.inner[1]
    assert adam.mu[2] == 0 and adam.nu[2] == 0 and adam.mu[0] != 0
    np.testing.assert_allclose(params[:2], [0.9, 0.9], rtol=1e-5)  # Adam's first step: lr


def test_a_bsp_round_averages_the_reports_and_checkpoints_round_trip():
    opt = with_buffers(sw.optim.sgd(1.0), ["bn.mean"])
    params = np.array([0.0, 0.0, 10.0], np.float32)
    shard = Shard(params, SEGMENTS, opt, workers=2, consistency=sw.BSP())
    for w in (0, 1):
        shard.join(w, incarnation=1)
    for w, report in ((0, 2.0), (1, 6.0)):
        ack = shard.push(PushHeader(w, 0, 0, 1), np.array([1.0, 1.0, report], np.float32))
        assert ack.ok
    assert params.tolist() == [-1.0, -1.0, 4.0]  # the mean gradient; the mean report
    restored = Shard(params.copy(), SEGMENTS, opt, workers=2, consistency=sw.BSP())
    restored.load_state_dict(shard.state_dict())
    assert restored.params.tolist() == params.tolist()


def _numpy_job(strategy) -> tuple:
    params = {"w": np.ones(2, np.float32), "bn": {"mean": np.zeros(1, np.float32)}}
    job = sw.Job(params, strategy=strategy, buffers=r"^bn\.")
    spec = job.config.spec
    assert spec.buffers == ("bn.mean",)
    return tree.unflatten(job.config.init.copy(), spec), spec


def count_up(params, batch):
    """A gradient for w; bn.mean counts the steps (its value after the step: + 1)."""
    return 0.0, {"w": params["w"] * 1.0, "bn": {"mean": params["bn"]["mean"] + 1.0}}


@pytest.mark.parametrize(
    ("strategy", "value"),
    [
        (sw.strategies.local_sgd(local_steps=3, inner=sw.optim.adamw(0.1, weight_decay=0.5)), 3.0),
        (sw.strategies.easgd(0.5, local_steps=3, inner=sw.optim.sgd(0.1)), 1.5),  # after its move
    ],
    ids=["local_sgd", "easgd"],
)
def test_model_averaging_pushes_the_buffers_values_after_its_local_steps(strategy, value):
    params, spec = _numpy_job(strategy)
    state = strategy.init(params)  # a tree made by unflatten: the job's spec, buffers marked
    assert state.spec is spec
    step = strategy.step(state, params, count_up, itertools.repeat(None))
    # three steps counted, no optimizer (nor AdamW's weight decay) on it
    assert step.update["bn"]["mean"].tolist() == [value]
    assert step.update["w"][0] > 0  # the parameters' pseudo-gradient


def test_own_loop_local_sgd_pushes_the_models_buffers(no_leaks):
    import torch

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    job = sw.Job(model, optimizer=sw.optim.sgd(1.0))
    x, y = (torch.from_numpy(a) for a in digit_batches(1.0, 1)[0][0])
    with job.serve(workers=1) as server:
        client = server.client(0)
        with sw.LocalSGD(client, model, opt, local_steps=2):
            for _ in range(2):
                torch.nn.functional.cross_entropy(model(x.reshape(-1, 1, 8, 8)), y).backward()
                opt.step()
                opt.zero_grad()
                expected = model[1].running_var.clone()
        pulled = server.pull()
        client.close()
    assert not torch.equal(expected, torch.ones(8))
    torch.testing.assert_close(pulled["1.running_var"], expected)  # sgd(1.0), rate 1: the value


# --- GPT-2 from a tiny transformers config -------------------------------------------------

VOCAB, CONTEXT = 256, 32


def make_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def tokens(seed: int, batches: int) -> list[np.ndarray]:
    """Sequences that count up by a per-sequence step: learnable from the context."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(batches, 8, 1))
    step = rng.integers(1, 4, size=(batches, 8, 1))
    return list((start + step * np.arange(CONTEXT)) % VOCAB)


def gpt2_loss_and_grad(params, batch):
    import torch

    model = _MODELS.get("gpt2") or _MODELS.setdefault("gpt2", make_gpt2())
    model.load_state_dict(params, strict=False)
    model.train()
    model.zero_grad()
    ids = torch.from_numpy(batch)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}  # wte: the tied one


def gpt2_eval_loss(model) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        ids = torch.from_numpy(np.concatenate(tokens(99, 4)))
        return float(model(ids, labels=ids).loss)


@pytest.mark.slow
def test_gpt2_with_tied_embeddings_is_stored_once_and_stays_tied(no_leaks):
    model = make_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    job = sw.Job(model, optimizer=sw.optim.adam(0.003))
    spec = job.config.spec
    assert spec.size == 120_576  # not 136,960: the 256 x 64 embedding once
    assert sum(p.numel() for p in model.parameters()) == spec.size
    assert sw.Job(model.state_dict(), optimizer=sw.optim.sgd(1.0)).config.spec.size == 120_576
    before = gpt2_eval_loss(model)
    result = job.train(
        gpt2_loss_and_grad,
        data=[tokens(w, 40) for w in range(WORKERS)],
        workers=WORKERS,
        steps=80,
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    assert result.params["lm_head.weight"] is result.params["transformer.wte.weight"]
    trained = make_gpt2()
    tree.unflatten_into(trained, result.flat, spec)
    assert trained.lm_head.weight is trained.transformer.wte.weight  # still tied
    after = gpt2_eval_loss(trained)
    assert after < 0.75 * before, (before, after)


# --- a flax nnx MLP with BatchNorm ------------------------------------------------------------


def make_nnx():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(64, 32, rngs=rngs)
            self.bn = nnx.BatchNorm(32, rngs=rngs)
            self.out = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x, train: bool):
            h = self.bn(self.hidden(x), use_running_average=not train)
            return self.out(nnx.relu(h))

    return MLP(nnx.Rngs(0))


@functools.cache
def _nnx_step():
    import jax
    import optax
    from flax import nnx

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, state, x, y):
        model = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits = m(x, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        # the nnx contract: gradients of the Params, and the BatchStats' new values
        return loss, nnx.merge_state(grads, nnx.state(model, nnx.BatchStat))

    return step


def nnx_loss_and_grad(state, batch):
    from flax import nnx

    graphdef = _MODELS.get("nnx") or _MODELS.setdefault("nnx", nnx.graphdef(make_nnx()))
    x, y = batch
    loss, update = _nnx_step()(graphdef, state, x, y.astype(np.int32))
    return float(loss), update


def nnx_eval_loss(model) -> float:
    _, _, x, y = digits()
    return _cross_entropy(np.asarray(model(x, train=False)), y)[0]


@pytest.mark.slow
def test_flax_nnx_mlp_with_batchnorm(no_leaks):
    from flax import nnx

    model = make_nnx()
    job = sw.Job(model, optimizer=sw.optim.adam(0.01))
    assert job.config.spec.buffers == ("bn.mean", "bn.var")
    before = nnx_eval_loss(model)
    result = job.train(
        nnx_loss_and_grad,
        data=digit_batches(1.0),
        workers=WORKERS,
        steps=240,
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    assert isinstance(result.params, nnx.State)
    tree.unflatten_into(model, result.flat, job.config.spec)  # writes the module's Variables
    assert not np.allclose(np.asarray(model.bn.var.get_value()), 1.0)
    after = nnx_eval_loss(model)
    assert after < 0.5 * before, (before, after)


# --- an equinox MLP ---------------------------------------------------------------------------


def make_eqx():
    import equinox as eqx
    import jax

    return eqx.nn.MLP(64, 10, 32, 1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))


@functools.cache
def _eqx_step():
    import equinox as eqx
    import optax

    @eqx.filter_jit
    def step(model, x, y):
        def loss_fn(m):
            logits = eqx.filter_vmap(m)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return eqx.filter_value_and_grad(loss_fn)(model)

    return step


def eqx_loss_and_grad(params, batch):
    """The equinox contract: the job holds the arrays; combine them with the static part."""
    import equinox as eqx

    static = _MODELS.get("eqx") or _MODELS.setdefault(
        "eqx", eqx.filter(make_eqx(), eqx.is_array, inverse=True)
    )
    x, y = batch
    loss, grads = _eqx_step()(eqx.combine(params, static), x, y.astype(np.int32))
    return float(loss), grads


def eqx_eval_loss(model) -> float:
    import equinox as eqx
    import jax.numpy as jnp

    _, _, x, y = digits()
    return _cross_entropy(np.asarray(eqx.filter_vmap(model)(jnp.asarray(x / 16))), y)[0]


@pytest.mark.slow
def test_equinox_mlp(no_leaks):
    import equinox as eqx

    model = make_eqx()
    job = sw.Job(model, optimizer=sw.optim.adam(0.01))  # the raw module: functions filtered out
    assert job.config.spec.size == 64 * 32 + 32 + 32 * 10 + 10
    before = eqx_eval_loss(model)
    result = job.train(
        eqx_loss_and_grad,
        data=digit_batches(1 / 16),
        workers=WORKERS,
        steps=200,
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    assert result.params.activation is None  # as eqx.filter(model, eqx.is_array)
    trained = eqx.combine(result.params, eqx.filter(model, eqx.is_array, inverse=True))
    after = eqx_eval_loss(trained)
    assert after < 0.5 * before, (before, after)


# --- a Keras 3 Sequential model on TensorFlow ---------------------------------------------------


def make_keras():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="out"),
        ],
        name="mlp",
    )


def keras_loss_and_grad(params, batch):
    """The Keras contract: assign the pulled variables, push ``tape.gradient``'s list."""
    import tensorflow as tf

    model = _MODELS.get("keras") or _MODELS.setdefault("keras", make_keras())
    for variable, value in zip(model.trainable_variables, params, strict=True):
        variable.assign(value)
    x, y = batch
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        )
    return float(loss), tape.gradient(loss, model.trainable_variables)


def keras_eval_loss(model) -> float:
    _, _, x, y = digits()
    return _cross_entropy(np.asarray(model(x / 16, training=False)), y)[0]


@pytest.mark.slow
def test_keras_sequential_on_tensorflow(no_leaks):
    model = make_keras()
    job = sw.Job(model.trainable_variables, optimizer=sw.optim.adam(0.01))  # a list
    spec = job.config.spec
    assert spec.segments.names == (
        "mlp/hidden/kernel",
        "mlp/hidden/bias",
        "mlp/out/kernel",
        "mlp/out/bias",
    )
    before = keras_eval_loss(model)
    result = job.train(
        keras_loss_and_grad,
        data=digit_batches(1 / 16),
        workers=WORKERS,
        steps=200,
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    tree.unflatten_into(model.trainable_variables, result.flat, spec)  # assigns the variables
    after = keras_eval_loss(model)
    assert after < 0.5 * before, (before, after)
