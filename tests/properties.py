"""Settings shared by the property-based tests (hypothesis): deterministic and database-free, so CI runs the same
examples every time and writes nothing to the working tree."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings


def property_settings(max_examples: int, shrink: bool = True):
    """Fixed examples (derandomize), no example database, no per-example deadline (CPU timing varies).

    shrink=False for tests whose examples run a model: a failure is then reported as found, without minutes of
    shrinking."""
    return settings(
        phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else []),
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=False,
    )
