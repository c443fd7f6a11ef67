"""The environment an engine starts from: an allow-list of the node's, never a secret.

A node's environment holds what Ray and the trackers need (Ray's token or its path, MLflow and W&B
credentials, the API's keys where serve runs); an engine runs a tenant's job and needs none of it. It gets the
variables named here (the runtime: paths, locale, CUDA, threads, the cache of models; horizon-ray's own), the
agent's explicit `env` (the operator's), and the extra names the node's operator lists in HORIZON_ENGINE_ENV
(e.g. MLFLOW_TRACKING_TOKEN for a tracker that needs one). Never the API's variables (SECRET_ENV_PREFIX) or
Ray's token.
"""

from __future__ import annotations

from collections.abc import Mapping

# Variables only the API process may see: the tenants' API keys and the path of their file.
SECRET_ENV_PREFIX = "HORIZON_API_"
ENV_ENGINE_ENV = "HORIZON_ENGINE_ENV"  # the node operator's extra names, comma-separated
# Ray's token authentication: an engine talks to no Ray process, and the token opens the whole cluster
_NEVER_PREFIXES = (SECRET_ENV_PREFIX, "RAY_AUTH_")
_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "MALLOC_ARENA_MAX",
    "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE",
    "TOKENIZERS_PARALLELISM", "MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
})
_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "TRITON_",
             "HORIZON_", "COV_CORE_", "COVERAGE_")


def allowed(name: str, extra: frozenset[str] = frozenset()) -> bool:
    """Whether a variable of the node's environment reaches an engine."""
    if name.startswith(_NEVER_PREFIXES):
        return False
    return name in _NAMES or name in extra or name.startswith(_PREFIXES)


def engine_base_env(node: Mapping[str, str], fixed: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an engine starts from: the allowed variables of the node's environment `node`, then the agent's
    explicit `fixed` ones (the operator's own), neither carrying the API's variables or Ray's token."""
    fixed = dict(fixed or {})
    names = {**node, **fixed}.get(ENV_ENGINE_ENV, "")
    extra = frozenset(n.strip() for n in names.split(",") if n.strip())
    env = {k: v for k, v in node.items() if allowed(k, extra)}
    env.update({k: v for k, v in fixed.items() if not k.startswith(_NEVER_PREFIXES)})
    return env
