"""Deprecated: the names of this module now live in the checkpoint package
and the format table; they are re-exported here for one release.

* naming schemes: :mod:`colibri.checkpoint.naming` (``Layout``,
  ``StackedLayout``, the built-ins, ``detect_layout``);
* the expert data model: :mod:`colibri.checkpoint.experts`
  (``ExpertTensors``, ``ModelExperts``, ``ROLES``, ``INTERLEAVED``,
  ``CONCATENATED``);
* scanning: :mod:`colibri.checkpoint.scan` (``scan_model``,
  ``experts_from_tensors``);
* formats and their scheme names: :mod:`colibri.formats` (``PLAIN``...
  ``SCHEMES``), FP8's block rule ``scale_block``: :mod:`colibri.formats.fp8`.
"""

from colibri.checkpoint.experts import CONCATENATED, INTERLEAVED, ROLES, ExpertTensors, ModelExperts
from colibri.checkpoint.naming import (BUILTIN_LAYOUTS, GPT_OSS, LLAMA4, MIXTRAL, MLP_EXPERTS, STACKED,
                                       STACKED_LAYOUTS, AnyLayout, Layout, StackedLayout, detect_layout)
from colibri.checkpoint.scan import experts_from_tensors, scan_model
from colibri.formats import (AWQ, FP8_BLOCK, GPTQ, GPTQ_V2, INT4, MXFP4, PLAIN, QUANT_MODULE_SCHEMES,
                             SCHEMES)
from colibri.formats.fp8 import scale_block

__all__ = [
    "ROLES",
    "Layout",
    "MIXTRAL",
    "MLP_EXPERTS",
    "BUILTIN_LAYOUTS",
    "StackedLayout",
    "GPT_OSS",
    "LLAMA4",
    "STACKED",
    "STACKED_LAYOUTS",
    "AnyLayout",
    "SCHEMES",
    "QUANT_MODULE_SCHEMES",
    "PLAIN",
    "FP8_BLOCK",
    "MXFP4",
    "INT4",
    "GPTQ",
    "GPTQ_V2",
    "AWQ",
    "INTERLEAVED",
    "CONCATENATED",
    "ExpertTensors",
    "ModelExperts",
    "scale_block",
    "detect_layout",
    "experts_from_tensors",
    "scan_model",
]
