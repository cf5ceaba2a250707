"""The run report: one HTML page and its JSON for a run (chunks, steps, checkpoints, failures), from
the run folder and, with a store, S3.

May import every layer below it (common ... alerts).
"""
