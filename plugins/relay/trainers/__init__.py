"""The trainers: each kind's chunk function (the contract in contract.py), run inside a Ray job.

What a kind is (its name, settings model and entry points, as import paths) lives in relay.spec.kinds,
below the spec that names it, so that reading a spec never imports a trainer. A trainer may import
every layer below it (common, spec, runs, data, checkpoints, s3, preflight, insights); only relay.jobs, the Airflow
shell and the CLI import a trainer's contract, and the job entry point (relay.trainers.job) runs it.
"""
