"""`relay stack` and `relay demo`: the local stack, and the demo DAG run on it."""

from __future__ import annotations

import sys

from relay.devstack import demo, stack


def cmd_stack(args) -> int:
    if args.action == "up":
        info = stack.up(
            with_airflow=not args.no_airflow,
            db_url=args.db,
            ray_cpus=args.ray_cpus,
            ray_gpus=args.ray_gpus,
            worker_nodes=args.ray_nodes,
        )
        for k, v in info.items():
            print(f"{k:>12}: {v}")
        if args.ray_nodes and any(n.name == "head" and n.alive and n.gpus for n in stack.ray_nodes()):
            print(
                "warning: the Ray head was started without worker nodes and keeps its GPUs, so training may run on it; "
                "`relay stack down` first for a head without GPUs",
                file=sys.stderr,
            )
    elif args.action == "down":
        print("stopped: " + ", ".join(stack.down(wait_s=args.wait)))
    else:
        print(f"state folder: {stack.state_dir()}")
        print("running: " + (", ".join(stack.running_services()) or "nothing started by relay"))
        if stack.ray_running():
            print(f"Ray cluster at {stack.ray_address()}:")
            for node in stack.ray_nodes():
                print(f"  {node.line()}")
    return 0


def cmd_demo(args) -> int:
    return demo.run(keep_running=args.keep_running, provoke_resume=not args.no_kill)


def add_commands(sub) -> None:
    s = sub.add_parser("stack", help="the local stack: S3, Ray head and Airflow (ports: include/stack.env)")
    s.add_argument("action", choices=["up", "down", "status"])
    s.add_argument("--no-airflow", action="store_true", help="only the Ray head")
    s.add_argument("--db", help="Airflow metadata DB URL (default: SQLite in the stack's state folder)")
    s.add_argument(
        "--ray-cpus",
        type=int,
        metavar="N",
        help="up: logical CPUs the Ray head advertises (default: the cores, at least 8, as a verl chunk "
        "on CPUs needs); fewer runs fewer chunk jobs at once",
    )
    s.add_argument(
        "--ray-gpus",
        type=int,
        default=stack.LOGICAL_GPUS,
        metavar="N",
        help="up, on a host without NVIDIA GPUs: logical GPUs the Ray head advertises (default 1), or with "
        "--ray-nodes each worker node; a verl spec holds its training world's, and separate_async's rollout one more each",
    )
    s.add_argument(
        "--ray-nodes",
        type=int,
        default=0,
        metavar="N",
        help="up: N worker nodes beside the head on this host, each its own raylet, ports (from "
        "RELAY_RAY_NODE_PORT_BASE) and --ray-gpus logical GPUs; the head then has none, so that training runs on "
        "the worker nodes (default 0: the head alone); again after a node was lost, it starts the missing ones",
    )
    s.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="down: wait this long for unfinished DAG runs to end first; those still unfinished are "
        "marked failed with a note saying the stack was stopped under them (default 0)",
    )
    s.set_defaults(func=cmd_stack)

    s = sub.add_parser("demo", help="run the demo spec's DAG end to end on the local stack")
    s.add_argument("--keep-running", action="store_true", help="leave the stack up to explore the UI")
    s.add_argument("--no-kill", action="store_true", help="no crash drill: chunk 2's trainer is not killed to show a resume")
    s.set_defaults(func=cmd_demo)
