"""The run spec: one YAML file per training run (relay.spec.run_spec) and its strict settings models
(model), the trainer kinds a spec may name (kinds), the chunk plan cut from it (plan) and the causes its
retry policy names (causes). Plain data and its validation: reading a spec touches no run folder.

May import relay.common only.
"""
