"""``horizon-ray drain``: stop this node's jobs with a checkpoint before the node goes away.

The preStop hook of a worker pod (k8s/): on a pod deletion or a node drain, the kubelet runs it before it
sends SIGTERM to the containers. It asks the node agent of this Ray node to take no new job and to have
every engine write a checkpoint at the end of its current step and stop (exit 143, resumable), and waits for
them; the coordinator then resumes those jobs on other nodes from the checkpoints. Without it the engines die
with the pod and lose the steps since their last periodic checkpoint.

Exit codes: 0 every engine stopped (or none ran), 1 some still ran at --timeout, 2 no Ray node here.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=240.0, metavar="SECONDS",
                        help="wait this long for the engines to stop (default 240; keep it below the pod's "
                             "terminationGracePeriodSeconds)")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster (default: RAY_ADDRESS, which KubeRay sets in its pods)")


def run(args: argparse.Namespace) -> int:
    import ray

    from horizon_ray.cluster.client import NAMESPACE, connect_ray
    from horizon_ray.cluster.ray_actors import AGENT_PREFIX, node_name_of

    try:
        connect_ray(args.address, NAMESPACE)
    except ConnectionError as exc:
        print(f"drain: no Ray node to drain here ({exc})", file=sys.stderr)
        return 2
    here = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == here), None)
    name = node_name_of(node) if node else here[:12]
    try:
        agent = ray.get_actor(AGENT_PREFIX + name, namespace=NAMESPACE)
    except ValueError:
        print(f"drain: node {name} runs no agent; nothing to stop")
        return 0
    running: list[str] = ray.get(agent.drain.remote(), timeout=60)
    print(f"drain: node {name} takes no new job; {len(running)} engine(s) checkpoint and stop: "
          f"{', '.join(running) or '-'}", flush=True)
    deadline = time.monotonic() + args.timeout
    while running and time.monotonic() < deadline:
        time.sleep(1.0)
        running = ray.get(agent.running.remote(), timeout=60)
    if running:
        print(f"drain: {len(running)} engine(s) still running after {args.timeout:.0f} s: {', '.join(running)}",
              file=sys.stderr)
        return 1
    print("drain: every engine stopped", flush=True)
    return 0
