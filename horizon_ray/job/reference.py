"""A preference job's reference: each row's summed completion log-prob under the starting weights, computed
once by streamed forwards before the first step and kept in the job's output directory.

Layout under ``<output_dir>/reference/``::

    logps.safetensors        "train" [rows], "eval" [rows] (float32), metadata {"hash": ...}: the finished pass
    part-00000.safetensors   "logps" of one slice of the pass, metadata {"hash", "split", "lo", "n"} (its first
                             micro-batch and their count): written as the pass goes (each atomic), so that a
                             job killed during it resumes where it stopped

``hash`` names what the log-probs are valid for: the model (its directory, config.json, and each weight file's
size and bytes sampled at its start, middle and end: another checkpoint of the same shape copied over it has
other values there), the starting adapters (method and lora section, seed) and every row's tokens and labels
(``pairs.data_hash``: data and tokenization). A file of another hash is never used: the pass starts over while
the job is at step 0, and a job past it (its weights are no longer the starting ones) is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from horizon_ray.atomic import Commit, atomic_path
from horizon_ray.errors import BadInput

DIR = "reference"
FINAL = "logps.safetensors"
# a slice of the pass is written at least this often (seconds of compute a kill may lose)
PART_EVERY_S = 60.0


# bytes of each weight file read at its start, middle and end for the reference's hash: a few MiB of I/O for any
# model, where hashing every byte of a 70B base would read 140 GB before each job's start
SAMPLE_BYTES = 1 << 20


def weights_fingerprint(path: Path) -> tuple[str, int, str]:
    """A weight file's name, size and a digest of three samples of its bytes."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))
    return path.name, size, h.hexdigest()[:16]


def reference_hash(spec: Any, data_hashes: list[str]) -> str:
    """What a reference is valid for: the model, the starting adapters, the rows (``data_hashes``)."""
    model = Path(spec.model.path).expanduser()
    config = model / "config.json"
    weights = sorted(weights_fingerprint(p) for p in model.glob("*.safetensors"))
    start = {"method": spec.method, "lora": spec.lora.model_dump(exclude={"merge"}) if spec.lora else None,
             "seed": spec.training.seed}
    blob = json.dumps({"model": str(model.resolve()), "config": config.read_text() if config.is_file() else "",
                       "weights": weights, "start": start, "data": data_hashes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load(out: Path, digest: str) -> dict[str, torch.Tensor] | None:
    """The finished reference of this hash, or None (none yet, or one of another model or data)."""
    path = out / DIR / FINAL
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get("hash") != digest:
            return None
    return load_file(str(path))


def compute(out: Path, digest: str, splits: dict[str, list], logps: Callable[[list], torch.Tensor],
            commit: Commit | None = None, on_part: Callable[[str, int, int], None] | None = None
            ) -> dict[str, torch.Tensor]:
    """Run the pass over ``splits`` (name -> micro-batches, rows in dataset order), ``logps`` of a list of
    micro-batches giving their rows' log-probs; slices already on disk under this hash are not computed again.
    Writes the finished file and removes the slices. ``on_part(split, micro-batches done, micro-batches)`` after
    each slice."""
    root = out / DIR
    root.mkdir(parents=True, exist_ok=True)
    done = _parts(root, digest)
    n_part = max((i for i, *_ in done), default=-1) + 1
    result = {}
    for split, batches in splits.items():
        have = {lo: (n, t) for _, s, lo, n, t in done if s == split}  # first micro-batch -> (count, log-probs)
        pieces, i = [], 0
        while i < len(batches):
            if i in have:  # this slice survived a kill
                n, t = have[i]
            else:
                n, t0, parts = 0, time.monotonic(), []
                # one slice: until PART_EVERY_S have passed, the split ends, or a slice on disk begins
                while i + n < len(batches) and (i + n) not in have and (not n or time.monotonic() - t0 < PART_EVERY_S):
                    parts.append(logps([batches[i + n]]))
                    n += 1
                t = torch.cat(parts)
                _write(root / f"part-{n_part:05d}.safetensors", t, digest, split, i, n, commit)
                n_part += 1
            pieces.append(t)
            i += n
            if on_part is not None:
                on_part(split, i, len(batches))
        result[split] = torch.cat(pieces) if pieces else torch.zeros(0)
    with atomic_path(root / FINAL, commit) as tmp:
        save_file(result, str(tmp), metadata={"hash": digest})
    for p in root.glob("part-*.safetensors"):
        p.unlink()
    return result


def required(out: Path, digest: str, step: int) -> None:
    """A job past step 0 must find its reference: its weights are no longer the starting ones."""
    raise BadInput(f"{out / DIR / FINAL} is missing or was computed for another model or data, and the job "
                   f"resumes at step {step}, whose weights are no longer the starting ones, so the reference "
                   "cannot be computed again; restore the file, or start the job afresh in another output_dir")


def _write(path: Path, t: torch.Tensor, digest: str, split: str, lo: int, n: int, commit: Commit | None) -> None:
    with atomic_path(path, commit) as tmp:
        save_file({"logps": t.contiguous()}, str(tmp),
                  metadata={"hash": digest, "split": split, "lo": str(lo), "n": str(n)})


def _parts(root: Path, digest: str) -> list[tuple[int, str, int, int, torch.Tensor]]:
    """(index, split, first micro-batch, micro-batches, log-probs) of the slices of this hash on disk; others are
    removed."""
    from safetensors import safe_open

    out = []
    for p in sorted(root.glob("part-*.safetensors")):
        with safe_open(str(p), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("hash") != digest:
                p.unlink()
                continue
            out.append((int(p.stem.split("-")[1]), meta["split"], int(meta["lo"]), int(meta["n"]),
                        f.get_tensor("logps")))
    return out
