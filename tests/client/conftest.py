"""Client tests use the integration suite's real clusters."""

from tests.integration.conftest import make_cluster

__all__ = ["make_cluster"]
