"""Operations: each thing a person or a DAG does to a run, as one function that takes the run and returns a result.

The front-ends (relay.cli, relay.airflow) import the core only through this layer (and relay.common), and add only
their own concerns: arguments and printing; Airflow's context, XCom, links, deferral and alert delivery. A decision
(retry or stop, ask a person, alert a deadline) is a pure function here that returns the decision; the front-end
acts on it.

May import every layer below it (common ... alerts).
"""
