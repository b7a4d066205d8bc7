"""Hypothesis profiles for the property tests, chosen by ``HYPOTHESIS_PROFILE`` (default "ci").

- "ci": derandomized (the same examples on every run), no deadline, a fixed number of
  examples per property (200: the whole suite in about two minutes on two cores, which
  keeps the README's test command under its 12-minute budget), and the reproduction blob
  printed with any failure.
- "dev": 2000 examples per property, freshly random on every run, for a broad local
  search (about a quarter of an hour): ``HYPOTHESIS_PROFILE=dev pytest property_tests``
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 200
DEV_EXAMPLES = 2000

# Tensors and layouts are drawn whole, so some inputs are slow to generate or large.
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=CI_EXAMPLES,
    print_blob=True,
    suppress_health_check=_SUPPRESSED,
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=DEV_EXAMPLES,
    print_blob=True,
    suppress_health_check=_SUPPRESSED,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
