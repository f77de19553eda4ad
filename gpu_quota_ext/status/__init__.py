"""What the server shows: the status view (view.py: the REST status answer and the /metrics families, built
in one place from the parts that know) and the one Prometheus collector of the process (collector.py).
Nothing else in the server speaks Prometheus."""

from .collector import COLLECTOR, host_memory_families, park_families
from .view import StatusView

__all__ = ["COLLECTOR", "StatusView", "host_memory_families", "park_families"]
