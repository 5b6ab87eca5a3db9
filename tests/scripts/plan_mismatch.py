import torch

import meshfit as mf

mf.parallelize(torch.nn.Linear(2, 2), "dp=4", loss_fn=torch.nn.functional.mse_loss)
