"""What a job's door tells an attaching process, as JSON data: nothing is unpickled.
A tree's structure travels in checkpoints' codec (:mod:`stalewise.checkpoint.spec`, ``live``)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from stalewise import codecs
from stalewise.checkpoint.spec import NotData, NotImported, spec_from_json, spec_to_json  # noqa: F401
from stalewise.consistency import Consistency
from stalewise.protocol import ServerConfig
from stalewise.runtime.local.layout import Layout
from stalewise.staleness import Staleness

if TYPE_CHECKING:
    from stalewise.runtime.local.client import Client

#: The longest state a door sends, in bytes (an attaching process reads no more).
MAX_STATE = 1 << 24

_CONSISTENCY = ("asp", "ssp", "bsp", "hybrid")
_STALENESS = ("constant", "inverse", "exponential", "polynomial")


def encode(config: ServerConfig, client: Client, workers: int) -> bytes:
    """The JSON document that lets an attaching process build ``client`` (raises NotData)."""
    spec = config.spec
    state = {
        "worker": client.worker,
        "incarnation": client.incarnation,
        "joined_at": client.joined_at,
        "block": client._block_name,
        "workers": workers,
        "layout": dataclasses.asdict(client._layout),
        "where": client._layout.where,
        "spec": spec_to_json(spec, live=True),
        "shards": config.shards,
        "replicas": config.replicas,
        "consistency": list(config.consistency),
        "staleness": list(config.staleness),
        "codec": _codec(config.codec),
    }
    body = json.dumps({"client": state}).encode()
    if len(body) > MAX_STATE:
        raise NotData(f"the job's state is {len(body)} bytes, over the door's {MAX_STATE}")
    return body


def _codec(policy: codecs.Policy) -> dict:
    """The table :func:`stalewise.codecs.parse` reads back as ``policy``."""
    if isinstance(policy, codecs.SizeAdaptive):
        return {"name": "size_adaptive", "threshold": policy.threshold,
                "small": _codec(policy.small), "large": _codec(policy.large)}  # fmt: skip
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    return {"name": policy.name, **fields}


def decode(body: bytes) -> tuple[str | None, Plan | None]:
    """What a door sent: ``(its refusal, None)`` or ``(None, the client's plan)``; else NotData."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and list(doc) == ["error"]:
            return str(_get(doc, "error", str)), None
        state = _get(doc, "client", dict)
        spec = spec_from_json(_get(state, "spec", dict), live=True)
        config = ServerConfig(
            spec=spec,
            init=np.empty(0, spec.dtype),  # a worker's client needs neither
            optimizer=None,
            consistency=_consistency(_get(state, "consistency", list)),
            staleness=_staleness(_get(state, "staleness", list)),
            shards=_count(_get(state, "shards", int), 1),
            replicas=_count(_get(state, "replicas", int), 1),
            codec=codecs.parse(_get(state, "codec", dict)),
        )
        layout = _layout(_get(state, "layout", dict))
        if layout.shards != config.shards or layout.size != spec.size:
            raise NotData(f"a layout of {layout.shards} shards, {layout.size} values")
        if _get(state, "where", list) != layout.where:
            return (
                "its shared memory is laid out as another stalewise does: attach with the "
                f"server's version (regions at {state['where']}, here {layout.where})",
                None,
            )
        return None, Plan(_count(_get(state, "worker", int)), _get(state, "block", str), layout,
                          config, _count(_get(state, "incarnation", int), 1),
                          _count(_get(state, "joined_at", int)),
                          _count(_get(state, "workers", int), 1))  # fmt: skip
    except NotData:
        raise
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise NotData(str(e) or type(e).__name__) from None


@dataclasses.dataclass(frozen=True)
class Plan:
    """An attaching process's client, as its door described it (:meth:`make` builds it)."""

    worker: int
    block: str
    layout: Layout
    config: ServerConfig
    incarnation: int
    joined_at: int
    workers: int  # the job's worker ids

    def make(self, conns: list) -> Client:
        """The client, over its pipes to the shards (one a shard)."""
        from stalewise.runtime.local.client import Client

        try:
            return Client(self.worker, self.block, self.layout, self.config, conns,
                          incarnation=self.incarnation, joined_at=self.joined_at)  # fmt: skip
        except (ValueError, TypeError) as e:  # e.g. a codec's plan that does not fit the spec
            raise NotData(str(e)) from None


def _get(d: Any, key: str, kind: type) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise NotData(f"no {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NotData(f"{key!r} is not a {kind.__name__}: {value!r:.80}")
    return value


def _count(n: int, least: int = 0) -> int:
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= least):
        raise NotData(f"expected an integer >= {least}, got {n!r:.80}")
    return n


def _real(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise NotData(f"expected a number, got {x!r:.80}")
    return float(x)


def _layout(d: dict) -> Layout:
    names = [f.name for f in dataclasses.fields(Layout)]
    if sorted(d) != sorted(names):
        raise NotData(f"a layout with fields {sorted(d)}")
    payloads = _get(d, "payloads", list)
    expected = d["expected"]
    if d["dtype"] not in ("float32", "float64") or not isinstance(d["feedback"], bool):
        raise NotData(f"a layout of dtype {d['dtype']!r:.40}")
    return Layout(_count(d["size"]), d["dtype"], _count(d["workers"], 1), _count(d["shards"], 1),
                  tuple(_count(p) for p in payloads), d["feedback"],
                  None if expected is None else _count(expected))  # fmt: skip


def _consistency(v: list) -> Consistency:
    if len(v) != 3 or v[0] not in _CONSISTENCY:
        raise NotData(f"consistency {v!r:.80}")
    return Consistency(v[0], _real(v[1]), _real(v[2]))


def _staleness(v: list) -> Staleness:
    if len(v) != 4 or v[0] not in _STALENESS:
        raise NotData(f"staleness {v!r:.80}")
    return Staleness(v[0], *(_real(x) for x in v[1:]))
