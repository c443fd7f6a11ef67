"""The engine's index spaces in one place.

- unit u: what streams through the device and what the optimizer updates in full fine-tuning. u = 0 is the
  embedding, u = 1..L the decoder layers, u = L + 1 the head (final norm, and the LM head unless tied).
- layer j = u - 1: what the layer template and the checkpoints are indexed by.
- adapter a (LoRA): a = j, the adapters (and trained norms) of layer j; a = L, the trained final norm when
  it is selected. Adapter a is read with unit a + 1.
- slot: where a unit sits on the device. Layers take a pool of 2 groups x K slots: layer j sits in group
  (j // K) % 2 at index j % K, so a whole block of K layers stays resident for its recompute and backward
  while the next block streams into the other group. The embedding and the head have a slot each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Units:
    L: int  # decoder layers
    K: int  # checkpoint interval: the input of every K-th layer is kept

    @property
    def embed(self) -> int:
        return 0

    @property
    def head(self) -> int:
        return self.L + 1

    @property
    def count(self) -> int:
        return self.L + 2

    def of_layer(self, j: int) -> int:
        return j + 1

    def layer(self, u: int) -> int | None:
        """The layer of unit u, None for the embedding and the head."""
        return u - 1 if 1 <= u <= self.L else None

    def slot(self, u: int) -> int | str:
        if u == self.embed:
            return "embed"
        if u == self.head:
            return "head"
        j = u - 1
        return ((j // self.K) % 2) * self.K + j % self.K

    @property
    def layer_slots(self) -> int:
        return 2 * min(self.K, max(self.L, 1))

    def blocks(self) -> list[tuple[int, int]]:
        """Layer ranges [s, e) recomputed together in the backward, bottom first."""
        return [(s, min(s + self.K, self.L)) for s in range(0, self.L, self.K)]

    def adapter_of(self, u: int, head_adapter: int | None) -> int | None:
        """The adapter read with unit u: layer u - 1's, or the head's trained final norm."""
        if 1 <= u <= self.L:
            return u - 1
        return head_adapter if u == self.head else None

    def backward_order(self, n_trained: int) -> list[int]:
        """Trained units (or adapters) in the order their gradients become final: the head first, the
        embedding (or the bottom layer's adapters) last."""
        return list(reversed(range(n_trained)))
