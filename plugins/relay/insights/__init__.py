"""What a run's own records tell a person: the goodput ledger (where the wall time went, what failures
cost), the ETA, the save interval that fits the run, the replay audit, the run report (HTML and JSON) and
the pre-resume checklist (`relay doctor`). Read-only over the run folder and, with a store, S3.

May import relay.common, relay.spec, relay.runs, relay.data, relay.checkpoints, relay.s3 and relay.preflight.
"""
