"""The run: its identity (relay.runs.run.Run: spec, name, folder, incarnation), the run folder's layout
(verl's checkpoint names, the tracker, Relay's .relay/ corner), the run record with its incarnation, the
lease (one writer per run), the run's metrics and events, the heartbeat, phase events and the
classification of a failed attempt.

May import relay.common and relay.spec.
"""
