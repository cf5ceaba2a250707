"""Relay: long verl RL runs carried through failures in resumable step-chunks.

Folders in layers, each importing only those below it (tests/project/test_architecture.py checks it):

    common < spec < runs < data < checkpoints < s3 < preflight < insights < trainers < jobs < alerts < ops
           < devstack < airflow;   cli/ above all but airflow

The core (everything but relay.airflow) is plain Python with no Airflow import; torch, verl, ray,
pyarrow, great-expectations and matplotlib (a third of a second, for the report's picture only) are
imported only inside the functions that need them, so that a DAG file or a spec check stays light.
Everything else is imported at the top of a module.
"""

__version__ = "0.4.0"
