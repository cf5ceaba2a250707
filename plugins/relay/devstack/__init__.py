"""The local stack on one machine (SeaweedFS, a Ray head, Airflow: `relay stack up`), the demo that
drives it, and a small client of Airflow's REST API.

Stays on the machine that runs it: relay.jobs.ray_jobs.NOT_SHIPPED keeps it out of Ray jobs, and no
layer below imports it. May import every layer below it.
"""
