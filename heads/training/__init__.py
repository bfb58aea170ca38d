"""What training the trained kinds share: batches of windows or stored target features (batches.py), packed
conversations (segments.py), a drafter unrolled over a window (unroll.py, training-time test), the anchors of the
block drafters' windows (anchors.py), the Recipe every objective returns (objective.py), the target's states over a
window (target_states.py) and rank accuracies (accuracy.py). The losses themselves live in each kind's folder
(heads/<kind>/objective.py)."""
