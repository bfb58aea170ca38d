import torch

# Tests are small: one thread avoids oversubscription on 2-core machines (and beside a training run).
torch.set_num_threads(1)
