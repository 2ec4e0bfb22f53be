"""torch.optim.Muon's Newton-Schulz iteration over one step's block matrices, beside
`cargo bench -p ember-train --bench newton_schulz -- LAYERS WIDTH D_FF` (experiments/speedrun.md).

torch runs its iteration in bf16 (`_zeropower_via_newtonschulz` converts the update); the f32 row is
the same function body on f32 tensors. One matrix after another, as the optimizer steps its
parameters; torch's CPU threads = the cores given (default 2). Median of 5 rounds after one warm-up.

    python experiments/ns_vs_torch.py 6 384 1024 [threads]
"""
import statistics
import sys
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

layers, d, ff = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (6, 384, 1024)
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) >= 5 else 2)
coeffs, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
# torch's [fan_out, fan_in]: q, k, v, o [d, d]; gate, up [ff, d]; down [d, ff].
shapes = [s for _ in range(layers) for s in [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff)]]
gen = torch.Generator().manual_seed(0)
mats = [torch.rand(s, generator=gen) * 2 - 1 for s in shapes]
flops = sum(5 * 2 * (min(s) ** 2 * max(s) * 2 + min(s) ** 3) for s in shapes)


def f32_iteration(grad):
    a, b, c = coeffs
    x = grad.clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


modes = {"f32": f32_iteration, "bf16 (torch.optim.Muon)": lambda g: _zeropower_via_newtonschulz(g, coeffs, steps, eps)}
times = {m: [] for m in modes}
for r in range(6):
    for name, fn in modes.items():
        t = time.perf_counter()
        for m in mats:
            fn(m)
        if r > 0:
            times[name].append(time.perf_counter() - t)
print(f"{len(shapes)} matrices ({layers} layers, width {d}, d_ff {ff}), {flops / 1e9:.1f} GFLOP, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads")
for name, t in times.items():
    m = statistics.median(t)
    print(f"{name:>24}: {m * 1e3:8.1f} ms  {flops / m / 1e9:6.1f} GFLOP/s")
