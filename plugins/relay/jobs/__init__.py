"""Ray jobs: submitting a chunk (or the gate) to a Ray cluster through the Jobs API with Relay's code as
a py_module, finding, following and stopping them.

May import every layer below it (common, spec, runs, ..., trainers: the chunk request's contract).
"""
