"""Alerts: what a person is told when a run needs them (the record, its rendering, noise control, stalls).

Plain Python: the channels that deliver an alert (Slack, SMTP, a JSON webhook) are Airflow provider
hooks, in relay.airflow.notifiers. May import every layer below it (common ... jobs).
"""

from relay.alerts.alert import KINDS, Alert, kind_of
from relay.alerts.ledger import AlertLedger
from relay.alerts.stall import StallWatch, stall_limit_s

__all__ = ["KINDS", "Alert", "AlertLedger", "StallWatch", "kind_of", "stall_limit_s"]
