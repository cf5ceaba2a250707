"""Task ids of a run DAG that other tasks read from (their XComs), in one place: the operators, the
task callables and the notifier all name them, and none of them should import another for a string."""

RUN_TASK = "preflight.run"  # pushes the training run (name, incarnation, dated spec) for every later task
