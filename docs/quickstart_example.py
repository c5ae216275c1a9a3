import copy, time
import torch
from torch import nn
import blockdiag

# The forum's model: 50 independent heads 150 -> 10 -> 10 -> 1, all reading the same x.
def head():
    return nn.Sequential(nn.Linear(150, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))

heads = nn.ModuleList(head() for _ in range(50))

def loop_of_heads(x):                 # slow: 150 small matmuls in a Python loop
    return torch.cat([h(x) for h in heads], dim=-1)

fast = blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads))   # same weights, one module

x = torch.randn(256, 150)
with torch.no_grad():
    torch.testing.assert_close(fast(x), loop_of_heads(x))      # identical outputs

def best_of(f, n=20):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(x).sum().backward(); ts.append(time.perf_counter() - t0)
    return min(ts)

t_loop, t_fast = best_of(loop_of_heads), best_of(fast)
print(f"loop {t_loop * 1e3:.2f} ms, GroupedMLP {t_fast * 1e3:.2f} ms: {t_loop / t_fast:.1f}x faster")
print(fast)                            # heads=50, in_features=150, hidden=[10, 10], ...
