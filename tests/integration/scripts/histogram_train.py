"""Worker script for the histogram test: ``STEPS`` (argv[1], default 6) Trainer steps of a small MLP
(``net.0.weight``, ``net.0.bias``, ``net.2.weight``, ``net.2.bias``) over dist_sync; run it with
``KVSTORE_HISTOGRAM_EVERY`` set to get weight and gradient histograms in TensorBoard."""

import sys

import torch

import kvstore

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
net = torch.nn.ModuleDict({"net": model})
trainer = kvstore.Trainer(net.named_parameters(), "sgd", {"learning_rate": 0.1})
x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
for _ in range(steps):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    for p in model.parameters():
        p.grad = None
    loss.backward()
    trainer.step(len(x))
trainer.kvstore.barrier()
trainer.kvstore.close()
