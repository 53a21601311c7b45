"""Run a transformers MoE model with its routed experts streamed by colibri.

    import colibri.hf
    model = colibri.hf.from_pretrained("path/to/model", slots_per_layer=8)
    out = model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=32)
    model.colibri_close()            # or: with colibri.hf.store_of(model): ...

:func:`from_pretrained` returns the ordinary ``PreTrainedModel`` that
``AutoModelForCausalLM.from_pretrained`` returns for the checkpoint, built by
transformers itself, with two of transformers' own extension points:

* a loading hook registered as a quantization method (``quant_method =
  "colibri"``, through ``register_quantizer`` / ``register_quantization_config``)
  that, on the meta-device skeleton and before any weight is read, removes the
  routed experts' fused parameters (``gate_up_proj``, ``down_proj``). transformers
  then loads every other tensor as usual and skips the experts' tensors as keys
  the model does not have, so no routed expert is ever read or allocated at load;
* an experts implementation registered in ``ExpertsInterface`` under
  ``"colibri"`` and selected with ``experts_implementation="colibri"``. Each MoE
  block's router stays the model's own; its experts module calls colibri's
  forward, which leases the union of the experts the batch chose
  (``Store.lease_many``), in groups that fit the layer's slots, computes them
  and releases them before returning.

PILOT: while MoE layer L runs, the next MoE layer's own router module is
applied to layer L's router input and the experts it names are prefetched,
right after layer L's own experts are leased. Its precision and recall are
those of :class:`colibri.Pilot` (``colibri.hf.runtime_of(model).pilot.report()``).

Block-scaled FP8 checkpoints (``quant_method: fp8``) load through
transformers' FP8 loader in dequantize mode, subclassed the same way: the
non-expert weights are dequantized at load, each routed expert when leased.
gpt-oss MXFP4 checkpoints (``quant_method: mxfp4``) quantize only the routed
experts, so the rest loads as a float checkpoint and each expert is
dequantized when leased. compressed-tensors checkpoints whose routed experts
are ``pack-quantized`` int4 load through transformers' compressed-tensors
loader in its dequantize mode (whatever else the checkpoint quantizes is
dequantized at load by compressed-tensors' own code), minus the routed
experts, each dequantized when leased. With ``kernels="native"`` (the
default) each non-expert linear layer stored packed (int4 or FP8 blocks) is
then computed from the checkpoint's bytes instead (:mod:`colibri.hf.linears`). :data:`ACCEPTED_QUANT_METHODS` is the
table of the ``quant_method`` values accepted.

Supported: transformers 5.x with the experts interface (tested on 5.24), and
the architectures in :data:`SUPPORTED_MODEL_TYPES`. See docs/hf.md.

The package, one job per module: :mod:`~colibri.hf.accept` (what it
accepts), :mod:`~colibri.hf.loaders` (the hooks registered with
transformers), :mod:`~colibri.hf.runtime` (the runtime and the experts'
forward), :mod:`~colibri.hf.linears` (the checkpoint's packed non-expert
linear layers, computed from their bytes) and :mod:`~colibri.hf.pretrained`
(:func:`from_pretrained`).
"""

from __future__ import annotations

from colibri.hf.accept import (
    ACCEPTED_QUANT_METHODS,
    CT_IMPLEMENTATION,
    CT_STRATEGIES,
    FP8_IMPLEMENTATION,
    IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_TRANSFORMERS,
    UNSUPPORTED_MOE_TYPES,
    QuantMethod,
    UnsupportedModelError,
    read_config,
)
from colibri.hf.pretrained import from_pretrained, module_parent_gate, runtime_of, store_of
from colibri.hf.runtime import LayerProgress, Runtime

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UNSUPPORTED_MOE_TYPES",
    "SUPPORTED_TRANSFORMERS",
    "ACCEPTED_QUANT_METHODS",
    "CT_STRATEGIES",
    "IMPLEMENTATION",
    "FP8_IMPLEMENTATION",
    "CT_IMPLEMENTATION",
    "QuantMethod",
    "UnsupportedModelError",
    "LayerProgress",
    "Runtime",
    "from_pretrained",
    "read_config",
    "module_parent_gate",
    "store_of",
    "runtime_of",
]
