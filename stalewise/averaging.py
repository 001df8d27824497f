"""Moved to :mod:`stalewise.strategies.averaging`; this old path still works, with a DeprecationWarning."""

import sys
import warnings

from stalewise.strategies import averaging as _moved

warnings.warn(
    "stalewise.averaging moved to stalewise.strategies.averaging (sw.strategies re-exports what it made "
    "public); import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
