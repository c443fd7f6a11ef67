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
        # checkpoints on their way to the host, oldest first: (event: the copy finished, the device tensors it reads)
        self._in_flight: list = []
        self._sent: dict = {}  # checkpoint key -> event: its copy to the host finished (read by its return)

    def stash(self, key, tensors: list[torch.Tensor]) -> None:
        self._free_in_flight(keep=1)  # at most two checkpoints in flight to the host: memory does not grow with L
        ready = torch.cuda.Event()
        ready.record(self.compute)
        host = []
        with torch.cuda.stream(self.d2h):
            # the activations are final once the compute stream has produced them
            self.d2h.wait_event(ready)
            for i, t in enumerate(tensors):
                buf = self.buffers.get((key, i), t.shape, t.dtype)
                buf.copy_(t, non_blocking=True)
                host.append(buf)
            sent = torch.cuda.Event()
            sent.record(self.d2h)
        # the stash holds the tensors until compute has waited for their copy (_free_in_flight), rather than marking
        # them used by the copy stream (record_stream): a block so marked returns to the allocator only once the
        # GPU has passed the host's free of it, and the host runs up to a launch queue ahead of the GPU, so every
        # layer of that lead would hold its activations (3.5 GiB at qwen3-4b's 16,384-token row groups on the H200)
        self._in_flight.append((sent, list(tensors)))
        self._sent[key] = sent
        self._kept[key] = host

    def _free_in_flight(self, keep: int) -> None:
        """The checkpoints in flight but the newest ``keep``, oldest first: compute waits for each one's copy to the
        host, after which the allocator may hand its device memory to any compute work queued later (stream
        order keeps it safe)."""
        while len(self._in_flight) > keep:
            sent, tensors = self._in_flight.pop(0)
            self.compute.wait_event(sent)
            del tensors  # freed after the wait is queued

    def prefetch(self, key) -> None:
        """Start bringing an offloaded checkpoint back to the device."""
        if key in self._returning:
            return
        # the first return comes right after the forward: all but the newest checkpoint in flight go now (the wait
        # the next stash would have queued, long passed), so the loss holds two checkpoints, as planned, not three,
        # and the returning one may take the freed memory
        self._free_in_flight(keep=1)
        host = self._kept[key]
        # allocated on the compute stream, which frees them in its own order once done with them (allocated on the
        # copy stream they would need record_stream, and so wait for the GPU to pass the host's free, see stash);
        # the copy starts once compute has reached this point of its queue, where the memory is no longer read
        with torch.cuda.stream(self.compute):
            dev = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in host]
            free = torch.cuda.Event()
            free.record(self.compute)
        with torch.cuda.stream(self.h2d):
            # read-after-write across the copy streams: the pinned buffers hold this checkpoint only once its
            # copy to the host has finished (the top blocks' come back while theirs may be queued)
            self.h2d.wait_event(self._sent.pop(key))
            self.h2d.wait_event(free)
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
        # the backward's first return comes after every copy to the host (the copy stream runs in order), so
        # the forward's last checkpoints in flight are freed at no wait
        self._free_in_flight(keep=0)
        return dev

    def reset(self) -> None:
        super().reset()
        # no returning block goes back to the allocator while its copy may still write it (the engine synchronizes
        # before it resets; this does not rely on that)
        for _, ev in self._returning.values():
            self.compute.wait_event(ev)
        self._returning.clear()
        self._free_in_flight(keep=0)
        self._sent.clear()
