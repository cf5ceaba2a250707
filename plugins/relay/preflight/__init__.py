"""What is decided before a chunk trains: which run a trigger continues or starts (and its guarded
fresh start), the settings-drift guard, the cheap checks before GPU time (settings, data freeze), and
the pre-resume checklist (`relay doctor`).

May import relay.common, relay.runs, relay.data and relay.checkpoints (and relay.s3).
"""
