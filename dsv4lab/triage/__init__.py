"""Triage notebooks' library side: everything a notebook cell (or a widget callback) calls.

Modules: :mod:`session` (model + tokenizer + prompts), :mod:`inspect_view`, :mod:`logits`,
:mod:`ablation`, :mod:`compressor_view`, :mod:`decode_view`, :mod:`bugs`, :mod:`metrics`,
:mod:`regression`, :mod:`plots`, :mod:`report`; the nightly with history: :mod:`nightly` (the
command's logic), :mod:`history` (run folders, manifests, rolling baseline, pruning),
:mod:`reference_view` (per-layer metrics against the reference), :mod:`failing` (a regression's
tensors), :mod:`trends` (the history's plots and index). The notebooks in ``notebooks/`` only glue these
together, so a headless papermill run and an interactive session execute the same code.
"""
