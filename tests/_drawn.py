"""Cases hypothesis draws in the parent process, to run many in one launch of ranks.

``drawn(strategy, n)``: ``n`` examples, the same on every run and machine (derandomized, no
example database), so a launch's cases are reproducible and one failing case can be rerun alone."""

from hypothesis import HealthCheck, Phase, given, settings


def drawn(strategy, n: int) -> list:
    cases: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases
