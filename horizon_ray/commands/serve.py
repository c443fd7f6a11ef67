"""``horizon-ray serve``: the service on a Ray cluster: node agents, the coordinator and the HTTP API.

    horizon-ray serve --simulate-nodes "a=16GiB,b=64GiB,c=256GiB"   # a local cluster of simulated nodes
    horizon-ray serve --simulate-nodes "a=64GiB,b=512GiB:2gpu"      # b: 2 logical GPUs, one job on each
    horizon-ray serve --address 10.0.0.1:6379                        # join a running Ray cluster
    horizon-ray serve --address 10.0.0.1:6379 --no-head-agent --no-api   # KubeRay: jobs on worker pods only

Starts (or joins) the cluster, a NodeAgent on every node, the detached coordinator, then the API
(`api.app:create_app`) on --host/--port; Ctrl-C stops what serve started. On a joined cluster the
coordinator and agents are detached actors: they keep running after serve exits (use --stop-on-exit to
remove them). The cluster's address is written to <root>/ray_address for `horizon-ray submit/status`, and
the port the API listens on (--port 0: one the OS picks) to <root>/api_port and serve's "API on http://" line.

A cluster serve starts runs Ray's dashboard and job server (--dashboard-port), so that `ray job submit --
horizon-ray finetune --config job.yaml` hands its spec to this service. The API needs keys
(HORIZON_API_KEYS or HORIZON_API_KEYS_FILE); without one serve refuses to start unless told
--insecure-no-auth. Every setting is listed by `serve --help` (api/settings.py's table). serve reads the API's
settings first, then drops every HORIZON_API_* variable from its environment before any Ray process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from horizon_ray.atomic import write_atomic
from horizon_ray.cluster.agent_protocol import ENGINE_LEASE_S
from horizon_ray.cluster.engine_env import SECRET_ENV_PREFIX
from horizon_ray.errors import BadInput
from horizon_ray.job.demo import DEMO_MODEL_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from api.settings import settings_text

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = settings_text()
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (host:port, or auto); default: start a local one")
    parser.add_argument("--simulate-nodes", default=None, metavar="a=16GiB,b=512GiB:2gpu",
                        help="start a local cluster whose nodes declare this RAM (and logical GPUs, cores) to "
                             "the planner: NAME=RAM[:Ngpu[@GPU_MEMORY]][:Ncpu], comma-separated")
    parser.add_argument("--root", type=Path, default=None,
                        help="service state: job table, default job outputs (default "
                             "$HORIZON_RAY_HOME/service)")
    parser.add_argument("--tenants", type=Path, default=None, metavar="TENANTS.yaml",
                        help="tenant quotas (default: every tenant gets the default quotas)")
    parser.add_argument("--host", default="127.0.0.1", help="API host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help=f"API port (default 8000; 0: a free one, printed and written to <root>/{API_PORT_FILE})")
    parser.add_argument("--no-api", action="store_true", help="start the coordinator and agents only")
    parser.add_argument("--no-head-agent", action="store_true",
                        help="start no node agent on the Ray head node, so that jobs run on worker nodes only (a "
                             "KubeRay head holds the GCS and the coordinator, not the data volumes)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve the API without API keys: every request is tenant 'default' (only on a "
                             "machine of your own, with --host 127.0.0.1)")
    parser.add_argument("--ray-port", type=int, default=None, metavar="PORT",
                        help="port of the Ray head (GCS) of a cluster serve starts (default: a free port)")
    parser.add_argument("--dashboard-port", type=int, default=8265, metavar="PORT",
                        help="port of Ray's dashboard and job server on a cluster serve starts (default 8265; "
                             "0 for none)")
    parser.add_argument("--node-dead-after", type=float, default=10.0, metavar="SECONDS",
                        help="a node unreachable this long loses its jobs to recovery (default 10)")
    parser.add_argument("--engine-lease", type=float, default=ENGINE_LEASE_S, metavar="SECONDS",
                        help="a node agent that has not heard from the coordinator this long stops its engines; the "
                             "coordinator waits as long (and a kill grace) before it recovers a lost node's jobs "
                             f"elsewhere (default {ENGINE_LEASE_S:.0f})")
    parser.add_argument("--demo-model", action=argparse.BooleanOptionalAction, default=None,
                        help=f"offer the embedded demo model as catalogue entry {DEMO_MODEL_NAME!r} (built into "
                             "$HORIZON_RAY_HOME/demo if missing), with its directory as a model root and a data "
                             "root (train.jsonl, eval.jsonl); default: on for a cluster serve starts, off with "
                             "--address (the nodes of a joined cluster may not see this machine's files)")
    parser.add_argument("--stop-on-exit", action="store_true",
                        help="on a joined cluster, remove the coordinator and agents when serve exits")


SECRETS_FD = "HORIZON_SERVE_SECRETS_FD"  # the memory file a re-executed serve reads its secrets from
RAY_TOKEN_VAR = "RAY_AUTH_TOKEN"  # Ray's token, when an operator gives it in the environment (a k8s Secret)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
API_PORT_FILE = "api_port"  # under the service root: the port the API of the serve running there listens on


def secret_names(environ: dict[str, str] | os._Environ) -> list[str]:
    """The variables of `environ` that hold a secret: the API's (keys, their file) and Ray's token."""
    return [k for k in environ if k.startswith(SECRET_ENV_PREFIX) or k == RAY_TOKEN_VAR]


def exec_without_secrets(argv: list[str]) -> None:
    """Start this serve again (`python -m horizon_ray ARGV`) with its secrets moved from the environment into an
    anonymous memory file it inherits: /proc/<pid>/environ shows a process's environment as it was at exec,
    whatever it deletes later, and every process of the same user reads it. Returns only when there is none."""
    names = secret_names(os.environ)
    if not names:
        return
    fd = os.memfd_create("horizon-ray-serve-secrets", 0)  # inherited across exec (no MFD_CLOEXEC)
    os.write(fd, json.dumps({k: os.environ[k] for k in names}).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    env = {k: v for k, v in os.environ.items() if k not in names}
    env[SECRETS_FD] = str(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "horizon_ray", *argv], env)


def take_secrets() -> dict[str, str]:
    """The secrets `exec_without_secrets` handed over (closing their memory file); {} when it did not run."""
    raw = os.environ.pop(SECRETS_FD, None)
    if raw is None:
        return {}
    with os.fdopen(int(raw), "rb") as f:
        return json.loads(f.read())


def run(args: argparse.Namespace) -> int:
    from api.settings import ENV_KEYS, ENV_KEYS_FILE, ApiSettings
    from horizon_ray.cluster.gate import GateConfig, service_credential
    from horizon_ray.cluster.local import default_root, use_ray_token
    from horizon_ray.cluster.nodes import parse_simulated_cluster
    from horizon_ray.cluster.tenants import TenantsConfig, format_bytes

    if sys.argv[1:2] == ["serve"]:  # this process is `horizon-ray serve`, not a test calling run()
        exec_without_secrets(sys.argv[1:])
    secrets = take_secrets()
    if RAY_TOKEN_VAR in secrets:  # this process's own connection to Ray needs it; its exec environment has it not
        os.environ[RAY_TOKEN_VAR] = secrets.pop(RAY_TOKEN_VAR)

    simulated = parse_simulated_cluster(args.simulate_nodes) if args.simulate_nodes else None
    if simulated and args.address:
        raise BadInput("--simulate-nodes starts its own local cluster; drop --address, or drop "
                       "--simulate-nodes to join the cluster at --address")
    if args.no_head_agent and not args.address:
        raise BadInput("--no-head-agent is for a joined cluster: add --address HOST:PORT (a local or "
                       "--simulate-nodes cluster needs the agent of its head, or runs none there already)")
    TenantsConfig.load(args.tenants)  # fail here, with the file's error, not inside the actor
    # Absolute, not resolved: a mounted ConfigMap file is a symlink into a timestamped folder that the kubelet
    # replaces on every edit of the ConfigMap; the coordinator (re)opens the path as given.
    tenants = args.tenants.absolute() if args.tenants else None
    root = (args.root or default_root()).expanduser().resolve()
    # the API's settings, checked before anything starts; their jobs root is also the coordinator's
    settings = ApiSettings.from_env({**os.environ, **secrets}, root=root, insecure_no_auth=args.insecure_no_auth)
    if not (settings.api_keys or args.insecure_no_auth):
        raise BadInput(f"the service has no API key, so it would refuse every call: set {ENV_KEYS}=KEY=TENANT (e.g. "
                       f"{ENV_KEYS}=$(python -c 'import secrets; print(secrets.token_urlsafe(24))')=me) or "
                       f"{ENV_KEYS_FILE} (also with --no-api: the coordinator checks the keys of the CLI and Ray "
                       "jobs), or pass --insecure-no-auth on a machine of your own (every setting: horizon-ray serve "
                       "--help)")
    settings.check_served_keys()
    if args.insecure_no_auth and settings.api_keys:
        raise BadInput(f"--insecure-no-auth with API keys set ({ENV_KEYS} or {ENV_KEYS_FILE}): drop one of them")
    if args.insecure_no_auth and not args.no_api and args.host not in LOOPBACK_HOSTS:
        raise BadInput(f"--insecure-no-auth serves the API without keys, so only on loopback: drop --host "
                       f"{args.host} (the default is 127.0.0.1), or set {ENV_KEYS} and drop --insecure-no-auth")
    if args.demo_model if args.demo_model is not None else not args.address:  # after the refusals: it builds
        settings = with_demo_model(settings)
    gate = GateConfig.from_keys(settings.api_keys, uploads_dir=settings.uploads_dir, jobs_root=settings.jobs_root,
                                data_roots=settings.data_roots, model_roots=settings.model_roots,
                                model_catalogue=settings.model_catalogue, tracker_hosts=settings.tracker_hosts)
    dashboard = args.dashboard_port if args.dashboard_port else None
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # The API's settings were read above, and its variables (the tenants' keys, their file) leave this process's
    # environment before any Ray process starts from it: no raylet, worker or engine inherits them.
    for name in [k for k in os.environ if k.startswith(SECRET_ENV_PREFIX)]:
        del os.environ[name]
    # Ray's token authentication: a cluster serve starts takes only clients that hold the token of <root>
    token = use_ray_token(root, create=not args.address)

    import ray

    from horizon_ray.cluster.client import NAMESPACE, RayClient, connect_ray
    from horizon_ray.cluster.local import (
        STORE_NAME,
        start_local_cluster,
        start_service,
        start_simulated_cluster,
        stop_service,
    )

    cluster = None
    if simulated:
        print(f"starting a local Ray cluster of {len(simulated)} simulated nodes ...", flush=True)
        cluster = start_simulated_cluster(simulated, dashboard_port=dashboard, port=args.ray_port)
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    elif args.address:
        connect_ray(args.address, NAMESPACE)
    else:
        print("starting a local Ray cluster on this machine ...", flush=True)
        cluster = start_local_cluster(dashboard_port=dashboard, port=args.ray_port)
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    started_cluster = cluster is not None
    from horizon_ray.cluster.ray_actors import coordinator_log_path

    coordinator_log = coordinator_log_path(root / STORE_NAME)
    log_from = _size(coordinator_log)  # what the coordinator logs from now on is printed here
    # SIGTERM (systemd, docker stop, kill) stops serve as Ctrl-C does, after Ray's own handler was installed by
    # ray.init (which dumps the stack); uvicorn re-raises it once the API has shut down
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        service = start_service(root, ram_by_node=simulated, tenants_file=tenants,
                                node_dead_after_s=args.node_dead_after, skip_head=args.no_head_agent,
                                jobs_root=settings.jobs_root, engine_lease_s=args.engine_lease, gate=gate)
        client = RayClient(credential=service_credential(settings.api_keys))  # the API's: it names each tenant
        address = ray.get_runtime_context().gcs_address
        print(f"horizon-ray service on Ray cluster {address} (namespace {NAMESPACE})")
        for node in client.nodes():
            gpus = (f"{node.gpu_count} GPU(s) of {format_bytes(node.gpu_memory_bytes)}" if node.gpu_count
                    else "no GPU")
            print(f"  node {node.node_id}: {format_bytes(node.ram_bytes)} RAM, {gpus}, {node.cpu_count} cores "
                  "split among its engines")
        print(f"  job table {service.store_path}; job outputs default to {service.jobs_root}/<tenant>/<job>")
        print(f"  coordinator log {coordinator_log} (printed here as it grows)")
        print(f"  clients: horizon-ray submit JOB.yaml --address {address}  (or --root {root}), with "
              "HORIZON_API_KEY set to a tenant's key")
        if token is not None:
            print(f"  Ray token authentication: clients of Ray need RAY_AUTH_MODE=token "
                  f"RAY_AUTH_TOKEN_PATH={token} (horizon-ray submit/status find it under --root)")
        jobs_url = f"http://{cluster.webui_url}" if cluster is not None and cluster.webui_url else None
        if jobs_url:
            print(f"  Ray Jobs: ray job submit --address {jobs_url} --runtime-env-json "
                  "'{\"env_vars\": {\"HORIZON_API_KEY\": \"...\"}}' -- horizon-ray finetune --config JOB.yaml")
        print(flush=True)
        threading.Thread(target=follow_log, args=(coordinator_log, log_from), name="coordinator-log",
                         daemon=True).start()
        if not simulated:
            threading.Thread(target=_rescan_nodes, args=(args.no_head_agent, args.engine_lease),
                             name="agent-rescan", daemon=True).start()
        if args.no_api:
            _wait()
        else:
            _serve_api(client, settings, args.host, args.port, root)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the cleanup short (SIGKILL does)
        print("serve: stopping", flush=True)
        if started_cluster or args.stop_on_exit:
            try:
                stop_service()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                print(f"warning: stopping the service: {exc}", file=sys.stderr)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def with_demo_model(settings):
    """`settings` that also offer the embedded demo model (built if missing): catalogue entry DEMO_MODEL_NAME
    unless the operator's catalogue has that name or names that model, its assets directory a model root and a
    data root."""
    from horizon_ray.job.demo import prepare_demo_assets

    assets, _ = prepare_demo_assets()
    # the operator's names first: a job's model is named by the first entry of its directory
    catalogue = {**settings.model_catalogue, DEMO_MODEL_NAME: settings.model_catalogue.get(DEMO_MODEL_NAME,
                                                                                          assets.model_dir)}
    return settings.replaced(model_catalogue=catalogue, model_roots=[*settings.model_roots, assets.root],
                             data_roots=[*settings.data_roots, assets.root])


def _wait() -> None:
    print("coordinator and agents running; Ctrl-C to stop", flush=True)
    while True:
        time.sleep(3600)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def follow_log(path: Path, offset: int, out=None, stop: threading.Event | None = None,
               interval_s: float = 0.5) -> None:
    """Print the complete lines appended to `path` from byte `offset` on, until `stop` is set (a file that
    shrank was rotated: it is read again from its start)."""
    stop = stop or threading.Event()
    while True:
        size = _size(path)
        if size < offset:
            offset = 0
        if size > offset:
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
            except OSError:
                data = b""
            end = data.rfind(b"\n") + 1
            if end:
                stream = out or sys.stdout
                stream.write(data[:end].decode("utf-8", "replace"))
                stream.flush()
                offset += end
        if stop.wait(interval_s):
            return


def _rescan_nodes(skip_head: bool, engine_lease_s: float) -> None:
    """On a real cluster, start an agent on every node that joins."""
    from horizon_ray.cluster.ray_actors import ensure_agents

    while True:
        time.sleep(5)
        try:
            ensure_agents(skip_head=skip_head, engine_lease_s=engine_lease_s)
        except Exception as exc:  # noqa: BLE001 - try again at the next scan
            print(f"warning: starting agents on new nodes: {exc}", file=sys.stderr)


def _serve_api(client, settings, host: str, port: int, root: Path) -> None:
    from api.app import create_app
    from api.server import listening_socket
    from api.server import serve as serve_app
    from api.settings import ENV_DATA_ROOTS, ENV_KEYS, ENV_MODEL_CATALOGUE, ENV_MODEL_ROOTS

    app = create_app(client, settings)
    # bound and listening before the port is told (printed, written): with --port 0 only the socket knows it,
    # and a client that reads it connects at once, its connection held in the backlog until uvicorn accepts
    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    write_atomic(root / API_PORT_FILE, f"{port}\n".encode())
    if settings.insecure_no_auth:
        print(f"warning: the API takes no key (--insecure-no-auth): anyone who reaches {host}:{port} acts as "
              f"tenant 'default'; set {ENV_KEYS} to require keys", file=sys.stderr)
    else:
        tenants = sorted(set(settings.api_keys.values()))
        print(f"API keys for tenant(s) {', '.join(tenants)}; send 'Authorization: Bearer <key>'")
    print(f"  job outputs {settings.jobs_root}/<tenant>/<job>; uploads {settings.uploads_dir}/<tenant>")
    print(f"  models (catalogue, {ENV_MODEL_CATALOGUE}): "
          + (", ".join(f"{name}={path}" for name, path in sorted(settings.model_catalogue.items())) or "none"))
    for var, roots in ((ENV_MODEL_ROOTS, settings.model_roots), (ENV_DATA_ROOTS, settings.data_roots)):
        print(f"  {'model' if var == ENV_MODEL_ROOTS else 'data'} roots ({var}): "
              + (", ".join(str(r) for r in roots) or "none"))
    print(f"API on http://{host}:{port}  (dashboard http://{host}:{port}/, OpenAI-compatible at "
          f"http://{host}:{port}/v1)", flush=True)
    try:
        serve_app(app, sock)  # with the API's limits on slow clients (api.server.server_config)
    finally:
        (root / API_PORT_FILE).unlink(missing_ok=True)  # no API listens there any more
