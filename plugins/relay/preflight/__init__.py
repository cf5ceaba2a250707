"""What is decided before a chunk trains: which run a trigger continues or starts (and its guarded
fresh start), the settings-drift guard, the cheap checks before GPU time (settings, data freeze), the
world size a resume can take, and the admission of a step's checkpoint with the run's spec (the gate, as
the validate task and its Ray job run it).

May import relay.common, relay.spec, relay.runs, relay.data and relay.checkpoints (and relay.s3).
"""
