"""What drafting kinds share: depth-by-depth tree expansion over a drafter's own cache (expansion.py), EAGLE-2's
dynamic tree grown on the device (grow_dynamic.py), layers called directly on CPUs (lean.py) and draft vocabularies
(vocab.py, FR-Spec). No module here imports a kind."""
