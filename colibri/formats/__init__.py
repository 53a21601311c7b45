"""The formats colibri reads, one record each, in one table.

Each module defines one way of storing an expert projection and builds its
:class:`~colibri.formats.record.Format` record: the parts and how a
checkpoint names them, the ``ColiTensorFormat`` / ``ColiScaleFormat``
values (read from the compiled library), the block or group rule, the
validation (plain facts, no expert objects) and the numpy and torch
decoders. :data:`FORMATS` maps each scheme name (``ExpertTensors.scheme``)
to its record; everything else (the checkpoint scanner, the store, the
dequantizers, colibri.hf) asks the record.

========== ============================== =========================================
scheme     module                         what
========== ============================== =========================================
plain      :mod:`colibri.formats.plain`   F32, F16, BF16, unscaled fp8
fp8_block  :mod:`colibri.formats.fp8`     F8_E4M3 with F32 block scales (DeepSeek-V3)
mxfp4      :mod:`colibri.formats.mxfp4`   e2m1 pairs, e8m0 scale per 32 (gpt-oss)
int4       :mod:`colibri.formats.int4`    compressed-tensors pack-quantized
gptq       :mod:`colibri.formats.gptq`    GPTQ, zero points stored minus one
gptq_v2    :mod:`colibri.formats.gptq`    GPTQ, zero points as they are
awq        :mod:`colibri.formats.awq`     AWQ GEMM
========== ============================== =========================================

Adding a format is one module, one entry below and its tests
(docs/design.md, "Adding a format").
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from colibri.errors import FormatError
from colibri.formats import awq, fp8, gptq, int4, mxfp4, plain
from colibri.formats.record import EITHER, IN_OUT, OUT_IN, Declared, Encoded, Format, RoleFacts, RoleParts

__all__ = ["FORMATS", "SCHEMES", "PLAIN", "FP8_BLOCK", "MXFP4", "INT4", "GPTQ", "GPTQ_V2", "AWQ",
           "QUANT_MODULE_SCHEMES", "Format", "RoleParts", "RoleFacts", "Declared", "Encoded",
           "format_of", "role_format", "OUT_IN", "IN_OUT", "EITHER"]

#: Every format, by scheme name, in the order of docs/formats.md.
FORMATS: Mapping[str, Format] = MappingProxyType({f.name: f for f in (
    plain.FORMAT, fp8.FORMAT, mxfp4.FORMAT, int4.FORMAT, gptq.FORMAT, gptq.FORMAT_V2, awq.FORMAT)})

PLAIN = plain.NAME
FP8_BLOCK = fp8.NAME
MXFP4 = mxfp4.NAME
INT4 = int4.NAME
GPTQ = gptq.NAME
GPTQ_V2 = gptq.NAME_V2
AWQ = awq.NAME
SCHEMES: tuple[str, ...] = tuple(FORMATS)
#: The GPTQ/AWQ family: (in, out) modules, per-input-row groups of scales.
QUANT_MODULE_SCHEMES: tuple[str, ...] = (GPTQ, GPTQ_V2, AWQ)


def format_of(scheme: str) -> Format:
    """The record of ``scheme``; FormatError for a name no format has."""
    found = FORMATS.get(scheme)
    if found is None:
        raise FormatError(f"unknown weight scheme {scheme!r} (known: {', '.join(FORMATS)})")
    return found


def role_format(scheme: str, scaled: bool) -> Format:
    """The format of one role of an expert stored as ``scheme``: a plain or
    fp8 expert's scaled roles are fp8 blocks, its unscaled ones plain."""
    if scheme in (PLAIN, FP8_BLOCK):
        return fp8.FORMAT if scaled else plain.FORMAT
    return format_of(scheme)
