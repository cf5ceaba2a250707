"""The Airflow shell over the core: hooks, triggers, operators, task callables and the DAG factory.

Each piece is thin: the work is done by relay.ops, whose functions the CLI calls too (the architecture test keeps
every import of the core here going through relay.ops or relay.common).
Nothing here imports torch, verl or ray at module level: DAG files are parsed often. The only folder
that imports Airflow; may import every other layer except relay.devstack, and stays behind when a
chunk ships to Ray (relay.jobs.ray_jobs.NOT_SHIPPED).
"""
