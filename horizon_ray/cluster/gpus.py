"""The GPUs a node's agent may hand out, from nvidia-smi (the cluster layer never initialises CUDA itself)."""

from __future__ import annotations

import os
import shutil
import subprocess


def detect_gpus(environ: dict[str, str] | None = None) -> tuple[list[str], int]:
    """(CUDA_VISIBLE_DEVICES value of each GPU the agent may hand out, memory of one GPU in bytes).

    From `nvidia-smi` (the cluster layer never initialises CUDA itself), restricted to the
    agent's CUDA_VISIBLE_DEVICES when that is set ("" or -1: none). Without nvidia-smi, the devices listed in
    CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES, with unknown memory. No GPU: ([], 0).
    """
    environ = dict(os.environ if environ is None else environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    exe = shutil.which("nvidia-smi")
    rows: list[tuple[str, str, int]] = []  # (index, uuid, bytes)
    if exe is not None:
        try:
            out = subprocess.run([exe, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            for line in out.splitlines():
                parts = [x.strip() for x in line.split(",")]
                if len(parts) == 3 and parts[0].isdigit():
                    rows.append((parts[0], parts[1], int(float(parts[2])) * 2**20))
        except (OSError, ValueError, subprocess.SubprocessError):
            rows = []
    if visible is not None:
        wanted = [x.strip() for x in visible.split(",") if x.strip()]
        if not rows:
            return ([] if wanted[:1] == ["-1"] else wanted), 0
        chosen: list[tuple[str, int]] = []
        for entry in wanted:
            match = next((r for r in rows if entry == r[0] or (entry.startswith("GPU-") and r[1].startswith(entry))),
                         None)
            if match is None:
                break  # CUDA ignores every entry from the first invalid one on
            chosen.append((entry, match[2]))
        return [e for e, _ in chosen], min((m for _, m in chosen), default=0)
    if not rows:
        listed = environ.get("NVIDIA_VISIBLE_DEVICES", "")
        ids = [x.strip() for x in listed.split(",") if x.strip()]
        if ids and all(x.isdigit() or x.startswith("GPU-") for x in ids):
            return [str(i) for i in range(len(ids))], 0
        return [], 0
    return [r[0] for r in rows], min(r[2] for r in rows)
