"""What the coordinator's next pass makes of jobs just submitted to a Ray cluster's coordinator: a submit
answers with the job queued, and the pass it wakes places it."""

from __future__ import annotations


def after_a_pass(client, *jobs):
    """`jobs` re-read after one complete pass of the coordinator actor (passes run one at a time, so this one
    starts after every submit before it has been answered)."""
    import ray

    from horizon_ray.cluster.client import COORDINATOR_NAME, NAMESPACE

    ray.get(ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE).tick.remote(), timeout=120)
    fresh = [client.get(j.tenant, j.id) for j in jobs]
    return fresh[0] if len(fresh) == 1 else fresh
