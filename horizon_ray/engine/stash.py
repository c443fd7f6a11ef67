"""Activation checkpoints: the input of every K-th layer, kept from the forward until the backward.

``KeptStash`` keeps the tensors where they are (the CPU path, or CUDA without offloading). ``OffloadStash``
sends each checkpoint to a pinned host buffer during the forward and brings it back one block ahead of the
backward, so device memory does not grow with the layer count or the checkpoint density.
"""

from __future__ import annotations

import torch

from horizon_ray.engine.pinned import HostBuffers


class KeptStash:
    def __init__(self) -> None:
        self._kept: dict = {}

    def stash(self, key, tensors: list[torch.Tensor]) -> None:
        self._kept[key] = tensors

    def prefetch(self, key) -> None:
        pass

    def unstash(self, key) -> list[torch.Tensor]:
        return self._kept.pop(key)

    def reset(self) -> None:
        self._kept.clear()


class OffloadStash(KeptStash):
    def __init__(self, device: torch.device, buffers: HostBuffers, h2d: torch.cuda.Stream, d2h: torch.cuda.Stream):
        super().__init__()
        self.device = device
        self.buffers = buffers
        self.compute = torch.cuda.current_stream(device)
        self.h2d, self.d2h = h2d, d2h
        self._returning: dict = {}  # checkpoint key -> (device tensors, event: their H2D copy landed)
        self._in_flight: list = []  # events: a checkpoint's copy to the host finished, oldest first
        self._sent: dict = {}  # checkpoint key -> event: its copy to the host finished (read by its return)

    def stash(self, key, tensors: list[torch.Tensor]) -> None:
        if len(self._in_flight) >= 2:
            # at most two checkpoints in flight to the host: the activations they hold are freed only once
            # their copy has read them, so an unbounded lead would grow device memory with L
            self.compute.wait_event(self._in_flight.pop(0))
        ready = torch.cuda.Event()
        ready.record(self.compute)
        host = []
        with torch.cuda.stream(self.d2h):
            # the activations are final once the compute stream has produced them
            self.d2h.wait_event(ready)
            for i, t in enumerate(tensors):
                buf = self.buffers.get((key, i), t.shape, t.dtype)
                buf.copy_(t, non_blocking=True)
                # the allocator must not hand t's memory to new work before this copy has read it
                t.record_stream(self.d2h)
                host.append(buf)
            sent = torch.cuda.Event()
            sent.record(self.d2h)
        self._in_flight.append(sent)
        self._sent[key] = sent
        self._kept[key] = host

    def prefetch(self, key) -> None:
        """Start bringing an offloaded checkpoint back to the device."""
        if key in self._returning:
            return
        host = self._kept[key]
        with torch.cuda.stream(self.h2d):
            # read-after-write across the copy streams: the pinned buffers hold this checkpoint only once its
            # copy to the host has finished (the top blocks' come back while theirs may be queued)
            self.h2d.wait_event(self._sent.pop(key))
            # allocated on the copy stream, released to the allocator only after compute has used it
            dev = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in host]
            for d, h in zip(dev, host):
                d.copy_(h, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        self._returning[key] = (dev, ev)

    def unstash(self, key) -> list[torch.Tensor]:
        self.prefetch(key)
        dev, ev = self._returning.pop(key)
        del self._kept[key]
        # read-after-write: the checkpoint must have landed before the recompute reads it
        self.compute.wait_event(ev)
        for d in dev:
            d.record_stream(self.compute)
        return dev

    def reset(self) -> None:
        super().reset()
        self._returning.clear()
        self._in_flight.clear()
        self._sent.clear()
