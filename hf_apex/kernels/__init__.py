"""The kernels and what puts them in a model: ``apex/`` binds apex's (availability, norms, optimizers), ``ops/``
holds hf_apex's own (the loss without logits), ``models/`` changes a transformers model per instance and reversibly
(norms rewired, the loss, RoPE, attention), ``passes/`` holds compiler passes; ``swap.py`` is the class swap they
share, ``trace.py`` the record of which implementation ran."""
