"""Airflow loads plugins from the .py files at the top of plugins/ (plugins/.airflowignore keeps it out
of the relay package): Relay's pages and trigger-form middleware in the API server."""

from relay.airflow.api_plugin import RelayPlugin

__all__ = ["RelayPlugin"]
