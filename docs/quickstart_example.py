import copy, time
import torch, blockdiag
from torch import nn

# The forum's model: 50 independent heads 150 -> 10 -> 10 -> 1, one input.
def head():
    return nn.Sequential(nn.Linear(150, 10), nn.ReLU(),
                         nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))

heads = nn.ModuleList(head() for _ in range(50))

def loop_of_heads(x):          # slow: 150 small matmuls in a Python loop
    return torch.cat([h(x) for h in heads], dim=-1)
# Same weights, one module: every layer is one grouped product.
fast = blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads))

x = torch.randn(256, 150)
with torch.no_grad():          # identical outputs (to float32 rounding)
    torch.testing.assert_close(fast(x), loop_of_heads(x))

def best_of(model, n=20):      # forward + backward, best of n
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        model(x).sum().backward()
        ts.append(time.perf_counter() - t0)
    return min(ts)
t_loop, t_fast = best_of(loop_of_heads), best_of(fast)
print(f"loop {t_loop * 1e3:.2f} ms, GroupedMLP {t_fast * 1e3:.2f} ms: "
      f"{t_loop / t_fast:.1f}x faster")
