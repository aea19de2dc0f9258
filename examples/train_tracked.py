"""A plain PyTorch training script with gpulens tracking added in two lines (marked ###).

python examples/train_tracked.py                 # makes its own gpulens run
gpulens run -- python examples/train_tracked.py  # steps go into gpulens's run
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpulens

device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
loader = DataLoader(data, batch_size=128, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
model = model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

with gpulens.track(name="tracked-example") as tracker:  ###
    for _epoch in range(3):
        for x, y in tracker.data(loader):  ### times the wait for each batch
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.step()  # optional: marks the end of the step explicitly
print(f"final loss {loss.item():.3f}")
