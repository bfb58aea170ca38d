"""Drafter checkpoints: treespec's own folders (drafter_folder.py), what a folder holds and which kind reads it
(detect.py), other projects' layouts (upstream_common.py, layer_config.py: a feature drafter's one layer as upstream
builds it), export for serving stacks (export.py) and the profile measured beside a checkpoint on this machine
(local_profile.py)."""
