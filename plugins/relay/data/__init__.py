"""Training data: quality checks (great-expectations), content-addressed frozen copies, and what
changed between a frozen copy and its source.

May import relay.common, relay.spec and relay.runs.
"""
