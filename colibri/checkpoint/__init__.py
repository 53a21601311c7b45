"""Reading a checkpoint, one job per module.

* :mod:`colibri.checkpoint.safetensors`: the safetensors header (and
  :mod:`colibri.checkpoint.dtypes`, its table of element types);
* :mod:`colibri.checkpoint.config`: the one reader of ``config.json``,
  ``quantize_config.json`` and ``quant_config.json``;
* :mod:`colibri.checkpoint.naming`: naming schemes (:class:`Layout`,
  :class:`StackedLayout`) and their detection;
* :mod:`colibri.checkpoint.experts`: the expert data model
  (:class:`ExpertTensors`, :class:`ModelExperts`);
* :mod:`colibri.checkpoint.scan` and :mod:`colibri.checkpoint.stacked`:
  from tensor names to validated experts, one expert per tensor or experts
  stacked in one tensor.

The package itself imports nothing, so that each module can be imported
alone (the formats need the header's ``TensorInfo``; the scanners need the
formats).
"""
