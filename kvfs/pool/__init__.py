"""The pool: its capacity, eviction and pins (`space`), the hosts that share it (`sessions`), and
the deletion of what nothing names any more (`reaper`)."""
