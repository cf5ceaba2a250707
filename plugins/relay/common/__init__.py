"""Shared vocabulary every layer uses: errors (each says what to do), secret redaction, UTC timestamps,
file locks, fault points for the fault tests, the project's folders, the per-step progress line, whether a
process is still the one that was seen, and library log noise kept quiet.

The lowest layer: imports nothing of Relay's outside this folder.
"""
