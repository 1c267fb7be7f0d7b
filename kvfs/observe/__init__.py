"""What operators see: the daemon's counters (`stats`), Prometheus (`metrics`), load throughput
per model (`loads`, `models`)."""
