"""SimConfig's validation errors carry the bad field and value, and config.py reads them."""

import pickle

import pytest

from stalewise import config
from stalewise.runtime.sim.config import TOML_KEYS, SimConfig
from stalewise.runtime.sim.models import Failure, SimConfigError


def test_errors_name_the_field_and_value_and_pickle():
    with pytest.raises(SimConfigError) as e:
        SimConfig.from_dict({"failures": [{"worker": 1, "time": -3}]})
    assert (e.value.owner, e.value.key, e.value.value, e.value.where) == (
        "Failure",
        "time",
        -3,
        "sim",
    )
    assert str(e.value) == "sim: Failure.time = -3: must be a finite number >= 0"
    again = pickle.loads(pickle.dumps(e.value))
    assert str(again) == str(e.value) and again.key == "time"
    with pytest.raises(SimConfigError, match=r"^compute = 'gamma': known models") as e:
        SimConfig.from_dict({"compute": "gamma"}, where="")
    assert (e.value.owner, e.value.key, e.value.value) == ("", "compute", "gamma")
    with pytest.raises(ValueError, match=r"^Failure.worker = True"):
        Failure(worker=True, time=1.0)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        # a value whose repr holds ": " was cut at it when the message was parsed back
        ({"shift": "a: b"}, "sim.shift: must be a finite number >= 0, got 'a: b'"),
        (
            {"compute": {"a": 1}},
            "sim.compute: known models are 'fixed' and 'exponential', got {'a': 1}",
        ),
        ({"speeds": [1, -1]}, "sim.speeds: must be a finite number >= 1e-06, got -1"),
        ({"failures": [{"worker": 1}]}, "sim.failures[0]: Failure.__init__() missing 1 required"),
    ],
)
def test_config_names_the_sim_key(table, message):
    with pytest.raises(config.ConfigError) as e:
        config._sim(table)
    assert str(e.value).startswith(message)


def test_the_sim_keys_are_listed_once():
    with pytest.raises(config.ConfigError, match="unknown option") as e:
        config._sim({"latncy": 1})
    assert str(e.value).endswith(f"(known: {', '.join(sorted(TOML_KEYS))})")
