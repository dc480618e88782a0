"""Helpers every job uses: atomic file writes and disk-space checks (io), one writer per
directory (lock), progress bars and log lines (progress), CPU threads on a busy machine
(threads), the device and its precision (device), optional dependencies (extras).

May import: aiayn.errors, aiayn.options.
"""
