"""Moved to :mod:`stalewise.strategies.adaptive`; this old path still works, with a DeprecationWarning."""

import sys
import warnings

from stalewise.strategies import adaptive as _moved

warnings.warn(
    "stalewise.adaptive moved to stalewise.strategies.adaptive (sw.strategies re-exports what it made "
    "public); import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
