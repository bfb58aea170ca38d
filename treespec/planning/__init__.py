"""Planning: what decides a run before it decodes, apart from the loop that decodes it.

Tree specs and their resolution (``tree_spec``, ``resolve``: the public ``treespec.generate`` resolves a spec, then
decodes), a drafter's measured profile and its cache (``profile``, ``profile_cache``), the cost model and the tree
"auto" chooses on it (``autotree``, ``engine_cost``, ``drafting_cost``), predicted acceptance (``analysis``,
``chain_tau``, ``measured_tau`` and ``model_free``: a drafter without accuracies, by a dry run), "auto" across drafters
(``across``) and timed comparisons (``bench``). Planning may call the decoding loop (``treespec.generate.decode``,
to measure by decoding); the loop never imports planning (tests/test_layering.py), so no decoding runs inside
another: whatever a tree needs is measured before its own decoding starts.
"""
