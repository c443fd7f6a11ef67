"""A quantized frozen base (LoRA's ``quantize``): each decoder layer's projections packed by bitsandbytes.

With ``LoraConfig(quantize="nf4")`` a layer unit's wire is one flat uint8 buffer (``PackedLayout``): for each
tensor of the unit, in the unit's order, its parts (``model.packed_parts``), each 16-byte aligned. A
quantized projection W [out, in] keeps what ``bitsandbytes.functional.quantize_4bit(W, blocksize=64,
compress_statistics=True, quant_type=...)`` returns, byte for byte: the 4-bit codes, the block scales
quantized to uint8 and the fp32 absmax and offset of that second quantization; under "int8", the int8 rows and
the fp32 row scales of ``int8_vectorwise_quant`` (LLM.int8's storage). Norms, biases and the router stay in
the compute dtype inside the same buffer; the embedding and head units are not packed. The packed bytes are
what lives in host RAM (~0.52 bytes a parameter for nf4) and what crosses to the device.

``views`` is where the packed base becomes weights: each quantized tensor is dequantized with bitsandbytes'
own functions (``dequantize_4bit``; for int8 the expression of bitsandbytes' ``MatMul8bitFp``, the path its
Linear8bitLt trains with on the CPU), into the compute dtype, on the device that holds the bytes, once per
read of the layer. The layer template then runs its GEMMs on those weights: the same products as
``bnb.matmul_4bit`` (dequantize, then ``F.linear``). On CUDA the bitsandbytes kernels run on the slot.

Quantization happens while loading (``pack``), one tensor at a time, in chunks of ``_CHUNK`` weights: the
codes and block scales of a chunk depend only on its blocks, the double quantization of the block scales
runs once over the whole tensor's scales, as ``quantize_4bit`` does. Peak beyond the store: one source tensor
plus a few fp32 chunks. On a CUDA engine the chunks are quantized on the GPU (as transformers does when it
moves a bitsandbytes model to the GPU); on the CPU by bitsandbytes' CPU backend.

A pre-quantized checkpoint (saved by transformers with a bitsandbytes ``quantization_config``) is read as it
is stored (``StoredTensor``: the codes and QuantState of a 4-bit weight, the rows and SCB of an int8 one) and
``take`` copies its bytes into the parts above where its quant state is ours (a checkpoint without double
quantization keeps its fp32 block scales: ``nested`` False); otherwise it is dequantized and packed.
"""

from __future__ import annotations

import torch

from horizon_ray.engine.model import (
    _PACK_ALIGN,
    QUANT_BLOCK,
    QUANT_NESTED_BLOCK,
    UnitLayout,
    _is_expert_key,
    is_quantized,
    packed_parts,
)
from horizon_ray.errors import BadInput

# Weights per chunk of a quantization pass: a multiple of QUANT_BLOCK x QUANT_NESTED_BLOCK (whole blocks).
_CHUNK = 1 << 22


def _bnb():
    """bitsandbytes' functional API, imported when a base is quantized (an engine without quantize, and the
    processes that only plan, never load it)."""
    try:
        import bitsandbytes.functional as F  # noqa: N812 (bitsandbytes' own name)
    except ImportError as exc:
        raise BadInput(f"lora.quantize needs bitsandbytes, which does not import here ({exc}); install it "
                       "(pip install 'horizon-ray[qlora]') or set lora.quantize to none",
                       field="lora.quantize") from exc
    return F


class PackedLayout:
    """Where each part of each tensor of one unit sits in its flat uint8 buffer."""

    def __init__(self, layout: UnitLayout, quantize: str, dtype: torch.dtype, nested: bool = True):
        """``nested``: 4-bit block scales double-quantized (model.packed_parts; False for a checkpoint saved
        without double quantization, whose fp32 scales are kept as they are)."""
        self.layout = layout
        self.quantize = quantize
        self.dtype = dtype
        self.nested = nested
        c = torch.empty(0, dtype=dtype).element_size()
        # key -> (kind, {part: (byte offset, bytes)})
        self.parts: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {}
        self._slots = {t.key: t for t in layout.tensors}
        self._members = {stack: [t.key for t in layout.stack_members(stack)] for stack, _, _ in layout.stacks}
        stack_of = {key: stack for stack, keys in self._members.items() for key in keys}
        offset = 0
        for t in layout.tensors:
            if t.key in self.parts:
                continue
            # a stack's members are laid out part by part (all their codes, then all their block scales, ...):
            # each part of the stack is then one strided run, which stack() dequantizes in one pass
            keys = self._members[stack_of[t.key]] if t.key in stack_of else [t.key]
            kinds = {key: quantize if is_quantized(key, quantize) else "none" for key in keys}
            listed = {key: packed_parts(kinds[key], self._slots[key].shape, c, nested) for key in keys}
            where: dict[str, dict[str, tuple[int, int]]] = {key: {} for key in keys}
            for i in range(len(listed[t.key])):
                for key in keys:
                    part, nbytes = listed[key][i]
                    where[key][part] = (offset, nbytes)
                    offset += -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
            for key in keys:
                self.parts[key] = (kinds[key], where[key])
        self.nbytes = offset
        self._runs = {stack: self._run_parts(keys) for stack, keys in self._members.items()}

    def _part(self, flat: torch.Tensor, key: str, part: str, dtype: torch.dtype) -> torch.Tensor:
        lo, nbytes = self.parts[key][1][part]
        return flat[lo:lo + nbytes].view(dtype)

    # ---- packing (load) ----------------------------------------------------------------------------------

    def pack(self, flat: torch.Tensor, key: str, w: torch.Tensor, device: torch.device) -> None:
        """Quantize tensor ``key`` (its HF shape, any float dtype) into the unit's buffer. The weights are first
        cast to the compute dtype: the model's dtype that transformers quantizes from."""
        kind, _ = self.parts[key]
        w = w.to(self.dtype).reshape(self._slots[key].shape)
        if kind == "none":
            self._part(flat, key, "w", self.dtype).copy_(w.reshape(-1))
        elif kind == "int8":
            self._pack_int8(flat, key, w, device)
        else:
            self._pack_4bit(flat, key, w, device)

    def _pack_4bit(self, flat, key, w, device) -> None:
        F = _bnb()
        w_flat = w.reshape(-1)
        codes = self._part(flat, key, "codes", torch.uint8)
        absmax = torch.empty(-(-w_flat.numel() // QUANT_BLOCK), dtype=torch.float32, device=device)
        for lo in range(0, w_flat.numel(), _CHUNK):
            chunk = w_flat[lo:lo + _CHUNK].to(device)
            # the op quantize_4bit runs (no double quantization yet: that needs every block's scale)
            c, a = torch.ops.bitsandbytes.quantize_4bit.default(chunk, QUANT_BLOCK, self.quantize, torch.uint8)
            codes[lo // 2:lo // 2 + c.numel()].copy_(c.reshape(-1))
            absmax[lo // QUANT_BLOCK:lo // QUANT_BLOCK + a.numel()] = a
        if not self.nested:  # quantize_4bit(compress_statistics=False): the scales stay fp32
            self._part(flat, key, "absmax", torch.float32).copy_(absmax)
            return
        # quantize_4bit(compress_statistics=True)'s second step, verbatim
        offset = absmax.mean()
        qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=QUANT_NESTED_BLOCK)
        self._part(flat, key, "absmax", torch.uint8).copy_(qabsmax)
        self._part(flat, key, "absmax2", torch.float32).copy_(state2.absmax)
        self._part(flat, key, "offset", torch.float32).copy_(offset.reshape(1))

    def _pack_int8(self, flat, key, w, device) -> None:
        F = _bnb()
        cb = self._part(flat, key, "cb", torch.int8).view(w.shape)
        scb = self._part(flat, key, "scb", torch.float32)
        rows = max(1, _CHUNK // w.shape[1])
        for lo in range(0, w.shape[0], rows):
            # what Int8Params does on its way to the device: row-wise absmax quantization of the fp16 weights
            c, s, _ = F.int8_vectorwise_quant(w[lo:lo + rows].to(device).to(torch.float16))
            cb[lo:lo + rows].copy_(c)
            scb[lo:lo + rows].copy_(s)

    def take(self, flat: torch.Tensor, key: str, src: StoredTensor, device: torch.device) -> None:
        """Tensor ``key`` from a checkpoint: a pre-quantized weight laid out as ours (same type, block sizes
        and code tables) is copied byte for byte, quant state included; any other is dequantized and packed
        (floats, the checkpoint's: quantized as ``pack`` does; a weight the store keeps in the compute dtype:
        dequantized as bitsandbytes does; a 4-bit weight of other block sizes: dequantized and quantized
        again, the one case of a second roundoff)."""
        kind, _ = self.parts[key]
        if src.kind == "none" or src.kind != kind or not self._same_layout(src):
            self.pack(flat, key, src.dequantized(self.dtype), device)
        elif kind == "int8":
            assert src.scb is not None, "an int8 weight comes with its row scales"
            self._part(flat, key, "cb", torch.int8).copy_(src.data.reshape(-1))
            self._part(flat, key, "scb", torch.float32).copy_(src.scb)
        else:
            st = src.state
            assert st is not None, "a 4-bit weight comes with its quant state"
            self._part(flat, key, "codes", torch.uint8).copy_(src.data.reshape(-1).view(torch.uint8))
            if self.nested:
                self._part(flat, key, "absmax", torch.uint8).copy_(st.absmax)
                self._part(flat, key, "absmax2", torch.float32).copy_(st.state2.absmax)
                self._part(flat, key, "offset", torch.float32).copy_(st.offset.reshape(1))
            else:
                self._part(flat, key, "absmax", torch.float32).copy_(st.absmax)

    def _same_layout(self, src: StoredTensor) -> bool:
        """Whether a stored 4-bit weight's quant state is the one our parts describe (int8 always is)."""
        st = src.state
        if st is None:
            return True
        if st.blocksize != QUANT_BLOCK or st.nested != self.nested:
            return False
        if not torch.equal(st.code.cpu(), _code((self.quantize, torch.device("cpu")))):
            return False
        return not st.nested or (st.state2.blocksize == QUANT_NESTED_BLOCK
                                 and torch.equal(st.state2.code.cpu(), _code(("dynamic", torch.device("cpu")))))

    # ---- unpacking (every read) ------------------------------------------------------------------------

    def plain(self, flat: torch.Tensor, key: str) -> torch.Tensor:
        """A tensor kept in the compute dtype (a norm, a bias, the router), as a view of the buffer."""
        assert self.parts[key][0] == "none", key
        return self._part(flat, key, "w", self.dtype).view(self._slots[key].shape)

    def dequantize(self, flat: torch.Tensor, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``key`` in the compute dtype, on the device of ``flat`` (into ``out`` when given)."""
        kind, _ = self.parts[key]
        shape = self._slots[key].shape
        if kind == "none":
            w = self.plain(flat, key)
            return w if out is None else out.copy_(w)
        if kind == "int8":
            cb = self._part(flat, key, "cb", torch.int8).view(shape)
            scb = self._part(flat, key, "scb", torch.float32)
            # bitsandbytes' MatMul8bitFp: CB in A's dtype times SCB / 127, in that order of rounding
            w = cb.to(self.dtype).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
            return w if out is None else out.copy_(w)
        # (bitsandbytes' CPU backend has no out= variant: the result is copied where it is wanted)
        w = _bnb().dequantize_4bit(self._part(flat, key, "codes", torch.uint8).view(-1, 1), self.quant_state(flat, key))
        return w if out is None else out.copy_(w)

    def quant_state(self, flat: torch.Tensor, key: str):
        """bitsandbytes' QuantState of a 4-bit tensor, over views of the buffer (nothing copied)."""
        F = _bnb()
        dev = flat.device
        if not self.nested:
            return F.QuantState(absmax=self._part(flat, key, "absmax", torch.float32),
                                shape=torch.Size(self._slots[key].shape), code=_code((self.quantize, dev)),
                                blocksize=QUANT_BLOCK, quant_type=self.quantize, dtype=self.dtype)
        state2 = F.QuantState(absmax=self._part(flat, key, "absmax2", torch.float32),
                              code=_code(("dynamic", dev)), blocksize=QUANT_NESTED_BLOCK, dtype=torch.float32)
        return F.QuantState(absmax=self._part(flat, key, "absmax", torch.uint8),
                            shape=torch.Size(self._slots[key].shape), code=_code((self.quantize, dev)),
                            blocksize=QUANT_BLOCK, quant_type=self.quantize, dtype=self.dtype,
                            offset=self._part(flat, key, "offset", torch.float32)[0], state2=state2)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the layer template reads (``UnitLayout.views`` of an unpacked unit): every tensor by key, the
        quantized ones dequantized, the experts as their stacks [E, rows, in]."""
        out = {}
        for t in self.layout.tensors:
            if not _is_expert_key(t.key):
                out[t.key] = self.dequantize(flat, t.key)
        for stack, _, shape in self.layout.stacks:
            out[stack] = self.stack(flat, stack, torch.empty(shape, dtype=self.dtype, device=flat.device))
        return out

    def stack(self, flat: torch.Tensor, stack: str, out: torch.Tensor) -> torch.Tensor:
        """An expert stack [E, rows, in] dequantized into ``out``: in one pass over all its members where their
        parts form runs (the same products as member by member, bit for bit: blockwise ops over the same blocks),
        else member by member. A layer of 128 experts was 384 dequantizations a read, each a few launches."""
        keys = self._members[stack]
        kind = self.parts[keys[0]][0]
        where = self._runs[stack]
        if where is None or kind == "none":
            rows = out.view(-1, out.shape[-1])
            row = 0
            for key in keys:
                n = self._slots[key].shape[0]
                self.dequantize(flat, key, out=rows[row:row + n])
                row += n
            return out
        runs = {part: flat.as_strided((len(keys), nbytes), (stride, 1), flat.storage_offset() + lo)
                for part, (lo, nbytes, stride) in where.items()}
        if kind == "int8":
            # MatMul8bitFp's expression (dequantize), over every member's rows at once
            return out.copy_(runs["cb"].view(torch.int8).to(self.dtype).view(out.shape)
                             .mul_(runs["scb"].view(torch.float32).reshape(*out.shape[:2], 1).mul(1.0 / 127.0)))
        if self.nested:
            # dequantize_blockwise of each member's block scales (code[q] x its absmax2 block) plus its offset
            absmax2 = runs["absmax2"].view(torch.float32)
            blocks = runs["absmax"].shape[1]
            scale = absmax2.repeat_interleave(QUANT_NESTED_BLOCK, dim=1)[:, :blocks]
            absmax = _code(("dynamic", flat.device))[runs["absmax"].long()].mul_(scale)
            absmax += runs["offset"].view(torch.float32)
        else:
            absmax = runs["absmax"].view(torch.float32)
        args = (runs["codes"].reshape(-1), absmax.reshape(-1), QUANT_BLOCK, self.quantize, out.shape, self.dtype)
        if out.device.type == "cuda":
            torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=out)  # (an out= op returns nothing)
            return out
        # (bitsandbytes' CPU backend has no out= variant)
        return out.copy_(torch.ops.bitsandbytes.dequantize_4bit.default(*args))

    def _run_parts(self, keys: list[str]) -> dict[str, tuple[int, int, int]] | None:
        """Each part of the members ``keys`` as one run, (first byte, bytes a member, stride): a [members, bytes]
        view of the unit's buffer; None where a pass over them would not be member by member's: shapes differ, a
        4-bit block straddles two rows or the codes are not back to back."""
        shapes = {self._slots[key].shape for key in keys}
        if len(shapes) != 1:
            return None
        shape = next(iter(shapes))
        if self.parts[keys[0]][0] in ("nf4", "fp4") and shape[-1] % QUANT_BLOCK:
            return None  # (bitsandbytes' CPU kernel indexes blocks by row: rows of whole blocks read the same)
        runs = {}
        for part, (lo, nbytes) in self.parts[keys[0]][1].items():
            stride = -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
            if any(self.parts[key][1][part][0] != lo + i * stride for i, key in enumerate(keys)):
                return None
            if part in ("codes", "cb") and stride != nbytes:
                return None  # the kernel reads the codes as one contiguous buffer
            runs[part] = (lo, nbytes, stride)
        return runs


_CODES: dict = {}


def _code(which: tuple[str, torch.device]) -> torch.Tensor:
    """bitsandbytes' code tables (the 4-bit type's 16 values, the dynamic map of the block scales), one copy
    per device."""
    if which not in _CODES:
        F = _bnb()
        kind, dev = which
        _CODES[which] = F.create_dynamic_map().to(dev) if kind == "dynamic" else F.get_4bit_type(kind, device=dev)
    return _CODES[which]


# ---- a pre-quantized checkpoint's tensors (transformers + bitsandbytes' serialization) ---------------------


def stored_owner(name: str) -> str:
    """The weight a checkpoint tensor belongs to: a 4-bit weight's quant state ("W.weight.absmax",
    "W.weight.quant_state.bitsandbytes__nf4", ...) and an int8 weight's row scales and format ("W.SCB",
    "W.weight_format") belong to "W.weight"; any other tensor is its own."""
    if ".weight." in name:
        return name[:name.index(".weight.")] + ".weight"
    if name.endswith(".SCB"):
        return name.removesuffix("SCB") + "weight"
    return name.removesuffix("_format") if name.endswith(".weight_format") else name


class StoredTensor:
    """One tensor of a checkpoint as it is stored: floats, or a weight bitsandbytes quantized (the codes in
    ``data`` with its QuantState; the int8 rows with their row scales)."""

    def __init__(self, name: str, data: torch.Tensor, companions: dict[str, torch.Tensor]):
        """``companions``: the tensors ``stored_owner`` maps to ``name``, by their full names."""
        self.name = name
        self.data = data
        self.state = None  # bitsandbytes' QuantState of a 4-bit weight
        self.scb = companions.get(name.removesuffix("weight") + "SCB")  # int8 row scales
        four_bit = {k.removeprefix(name + "."): v for k, v in companions.items() if k.startswith(name + ".")}
        fmt = companions.get(name + "_format")
        if fmt is not None and int(fmt) != 0:
            raise BadInput(f"{name} is stored in bitsandbytes' int8 weight format {int(fmt)} (a tiled GPU layout of "
                           "older versions, not rows); save the checkpoint again with a current bitsandbytes "
                           "(weight_format 0) or give the bf16 checkpoint")
        if four_bit:
            self.state = _bnb().QuantState.from_dict(four_bit, device=torch.device("cpu"))
            self.kind = self.state.quant_type
        elif self.scb is not None:
            self.kind = "int8"
        else:
            if not data.is_floating_point():
                raise BadInput(f"tensor {name} has dtype {data.dtype} and no bitsandbytes quant state beside it; "
                               "expected a floating-point tensor")
            self.kind = "none"

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's own shape (a 4-bit weight's codes are stored [numel / 2, 1])."""
        return tuple(self.state.shape) if self.state is not None else tuple(self.data.shape)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights in ``dtype``, as bitsandbytes multiplies by them (quant.py's dequantize)."""
        if self.kind == "int8":
            assert self.scb is not None, "an int8 weight comes with its row scales"
            return self.data.to(dtype).mul_(self.scb.unsqueeze(1).mul(1.0 / 127.0))
        if self.state is not None:
            # straight into ``dtype``, as the forward of bitsandbytes' MatMul4Bit dequantizes into the activations'
            # dtype (the state's own dtype, the weights' when they were quantized, is what its backward uses)
            self.state.dtype = dtype
            return _bnb().dequantize_4bit(self.data.reshape(-1).view(torch.uint8).view(-1, 1), self.state)
        return self.data
