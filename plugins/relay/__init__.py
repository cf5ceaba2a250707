"""Relay: long verl RL runs carried through failures in resumable step-chunks.

The core (this package, minus relay.airflow) is plain Python with no Airflow import; torch, verl
and ray are imported only inside the functions that need them.
"""

__version__ = "0.1.0"
