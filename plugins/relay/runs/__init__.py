"""What a training run is and where its files live: the run spec (and its strict settings models), the
trainer kinds it may name, the chunk plan, the run folder's layout (checkpoints, tracker, .relay/), the
run record with its incarnation, the lease (one writer per run), and the run's events and metrics.

May import relay.common only.
"""
